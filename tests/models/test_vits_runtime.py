"""The VITS runtime (service/models/vits/runtime.py) and the audio the engine serves from it:
chunks equal the reference full decode (staged and slot decoders, several schedules, both CPU
backends), seams, seeds, controls, word timings, the acoustic stage's batching and its prior."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from service.audio.encoding import AudioEncoding
from service.engine.config import BatchConfig, EngineConfig
from service.engine.contract import AudioOut, Precision, SessionConfig, SessionSummary
from service.engine.frontend_pool import FrontendPoolConfig
from service.engine.local import LocalEngine
from service.models.family import AcousticJob, ChunkSchedule, SynthesisParams, utterance_rng
from service.models.registry import open_voice
from service.models.vits.runtime import Utterance, VitsRuntime
from service.models.vits.voice import read_piper_voice
from service.voices import builtin_voice_info
from tests.asr import transcribe, word_error_rate

DATA = Path(__file__).resolve().parent.parent / "data"
TINY = "tiny-multi"
# Two sentences, which the engine's segmenter serves as two utterances (the comma comes too
# early for a first-clause cut): compared utterance by utterance with the frontend's sentences.
TEXT = "Hello there, this is a test of chunked decoding. It has two sentences!"
SCHEDULES = [
    ChunkSchedule(first_frames=1, growth=1.0, max_frames=1),
    ChunkSchedule(first_frames=3, growth=2.0, max_frames=16),
    ChunkSchedule(first_frames=8, growth=4.0, max_frames=256),
    ChunkSchedule(first_frames=5, growth=1.5, max_frames=7),
]
# (backend, engine decoder): ONNX Runtime has the staged decoder only; torch has both.
DECODERS = [("onnxruntime", "staged"), ("torch", "staged"), ("torch", "slots")]


def open_engine(backend: str, decoder: str, schedule: ChunkSchedule, cache: str, voice: str | None = TINY,
                shadow_fraction: float = 0.0) -> LocalEngine:
    """The engine the server runs, in this process. With the slot decoder the schedule's
    first_frames is the first step (plus the lag) and max_frames every later step's size."""
    return LocalEngine(EngineConfig(
        voice=voice, voices_dir=DATA if voice else None, backend=backend, device="cpu", threads=1, cache_bytes=0,
        cache_dir=Path(cache), frontend=FrontendPoolConfig(workers=0), core="thread", schedule=schedule,
        batch=BatchConfig(decoder=decoder, step_frames=schedule.max_frames), warmup_text="Warm up.",
        shadow_fraction=shadow_fraction,
    ))


def served(local: LocalEngine, text: str, **session: object) -> tuple[list[list[np.ndarray]], SessionSummary]:
    """The chunks the engine serves for `text`, per utterance, and the session's summary."""
    config = SessionConfig(encoding=AudioEncoding.FLOAT32, **{"precision": Precision.FP32, **session})  # type: ignore[arg-type]
    chunks: dict[int, list[np.ndarray]] = {}
    summary = None
    for event in local.stream(text, config):
        if isinstance(event, AudioOut):
            if event.num_samples:
                chunks.setdefault(event.utterance, []).append(np.frombuffer(event.audio, dtype="<f4"))
        else:
            summary = event
    assert summary is not None
    return [chunks[k] for k in sorted(chunks)], summary


def utterances(runtime: VitsRuntime, text: str, seed: int | None, speaker: int | str | None = None,
               **params: object) -> list[Utterance]:
    """`text`'s sentences through the acoustic stage, each with the noise the engine gives it."""
    sid = runtime.info.speaker_index(speaker)
    p = SynthesisParams(speaker=speaker, seed=seed, **params)  # type: ignore[arg-type]
    jobs = [AcousticJob(s, sid, p, utterance_rng(seed, s.phoneme_ids))
            for s in runtime.voice.frontend.sentences(text) if s.phoneme_ids]
    return runtime.acoustic_batch(jobs)


def references(runtime: VitsRuntime, text: str, seed: int, speaker: int | str | None = None) -> list[np.ndarray]:
    """Each sentence decoded whole (no chunks): what the served chunks must equal."""
    return [runtime.reference(u) for u in utterances(runtime, text, seed, speaker)]


class Runtimes(dict[tuple[str, str], VitsRuntime]):
    """(voice, backend) -> a runtime of its own (not the engine's) for the references, opened on first use."""

    def __init__(self, cache: str) -> None:
        super().__init__()
        self.cache = Path(cache)

    def __missing__(self, key: tuple[str, str]) -> VitsRuntime:
        info = read_piper_voice(DATA / f"{TINY}.onnx") if key[0] == "tiny" else builtin_voice_info()
        runtime = open_voice(info, key[1], "cpu", cache_dir=self.cache)
        assert isinstance(runtime, VitsRuntime)
        self[key] = runtime
        return runtime


@pytest.fixture(scope="module")
def runtimes(onnx_cache_dir: str) -> Runtimes:
    return Runtimes(onnx_cache_dir)


@pytest.fixture(scope="module")
def tiny_ort_engine(onnx_cache_dir: str) -> Iterator[LocalEngine]:
    with open_engine("onnxruntime", "staged", ChunkSchedule(), onnx_cache_dir) as local:
        yield local


def _peak_err(chunked: np.ndarray, full: np.ndarray) -> tuple[float, float]:
    return float(np.abs(chunked - full).max()), float(np.abs(full).max())


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: f"{s.first_frames}-{s.growth:g}-{s.max_frames}")
@pytest.mark.parametrize(("backend", "decoder"), DECODERS, ids=lambda v: v)
def test_served_chunks_equal_the_reference_decode(runtimes: Runtimes, onnx_cache_dir: str,
                                                  backend: str, decoder: str, schedule: ChunkSchedule) -> None:
    """Every utterance the engine serves, cut by the schedule (staged chunks or slot steps),
    equals the runtime's reference decode of the same seeded sentence."""
    refs = references(runtimes["tiny", backend], TEXT, seed=7, speaker=1)
    assert len(refs) == 2
    with open_engine(backend, decoder, schedule, onnx_cache_dir) as local:
        got, summary = served(local, TEXT, seed=7, speaker=1)
    assert len(got) == len(refs) == summary.utterances
    assert len(got[0]) > 1  # the first utterance really was cut (later ones start with a larger chunk)
    for pieces, full in zip(got, refs, strict=True):
        chunked = np.concatenate(pieces)
        assert chunked.shape == full.shape
        err, peak = _peak_err(chunked, full)
        # Scale-free check: the tiny voice is quiet, so compare relative to its peak.
        assert err <= 1e-4 * max(peak, 1e-3), (err, peak)


@pytest.mark.parametrize(("backend", "decoder"), DECODERS, ids=lambda v: v)
def test_builtin_voice_chunks_equal_the_reference_decode(runtimes: Runtimes,
                                                         onnx_cache_dir: str, backend: str, decoder: str) -> None:
    text = "Streaming keeps the seams invisible."
    (full,) = references(runtimes["builtin", backend], text, seed=3)
    schedule = ChunkSchedule(first_frames=8, growth=2.0, max_frames=32)
    with open_engine(backend, decoder, schedule, onnx_cache_dir, voice=None) as local:
        (pieces,), _ = served(local, text, seed=3)
    chunked = np.concatenate(pieces)
    assert len(pieces) > 3
    assert chunked.shape == full.shape
    assert float(np.abs(chunked - full).max()) <= 1e-4
    # No clicks: the jump between neighbouring samples at every seam is what the
    # full decode has at the same place (up to the exactness tolerance).
    seams = np.cumsum([len(p) for p in pieces])[:-1]
    for s in seams:
        assert abs(abs(chunked[s] - chunked[s - 1]) - abs(full[s] - full[s - 1])) <= 2e-4


def test_onnxruntime_stages_reproduce_torch(runtimes: Runtimes) -> None:
    from service.audio.quality import psnr_db

    text = "The exported stage graphs compute the same function."
    (a,) = utterances(runtimes["builtin", "torch"], text, seed=11)
    (b,) = utterances(runtimes["builtin", "onnxruntime"], text, seed=11)
    assert np.array_equal(a.durations, b.durations)
    x, y = runtimes["builtin", "torch"].reference(a), runtimes["builtin", "onnxruntime"].reference(b)
    assert len(x) == len(y)
    assert psnr_db(x, y) >= 60.0


def test_same_seed_same_samples_other_seed_differs(tiny_ort_engine: LocalEngine) -> None:
    def audio(**session: object) -> np.ndarray:
        got, _ = served(tiny_ort_engine, TEXT, **session)
        return np.concatenate([p for pieces in got for p in pieces])

    a, b, c = audio(seed=1), audio(seed=1), audio(seed=2)
    assert np.array_equal(a, b)
    assert len(a) != len(c) or not np.array_equal(a, c)


def test_length_scale_changes_duration(builtin_ort: VitsRuntime) -> None:
    text = "Speaking rate is a length scale."
    quiet = (("noise_w", 0.0),)
    (normal,) = utterances(builtin_ort, text, 4, options=quiet)
    (slow,) = utterances(builtin_ort, text, 4, options=quiet, length_scale=1.5)
    assert 1.3 < slow.frames / normal.frames < 1.7
    assert len(builtin_ort.reference(slow)) == slow.frames * builtin_ort.hop


def test_unknown_speaker_is_an_error(runtimes: Runtimes,
                                     tiny_ort_engine: LocalEngine) -> None:
    info = runtimes["tiny", "onnxruntime"].info
    with pytest.raises(LookupError, match=r"speakers 0\.\.2"):
        info.speaker_index(7)
    with pytest.raises(LookupError, match="no speaker 'dave'"):
        info.speaker_index("dave")
    assert info.speaker_index("bob") == info.speaker_index(1) == 1
    a, _ = served(tiny_ort_engine, "hi", speaker="bob", seed=1)
    b, _ = served(tiny_ort_engine, "hi", speaker=1, seed=1)
    assert np.array_equal(np.concatenate(a[0]), np.concatenate(b[0]))


def test_word_timings_follow_durations(builtin_ort: VitsRuntime, onnx_cache_dir: str) -> None:
    text = "One two three. Four five!"
    with open_engine("onnxruntime", "staged", ChunkSchedule(), onnx_cache_dir, voice=None) as local:
        words, total = [], 0
        for event in local.stream(text, SessionConfig(seed=5, encoding=AudioEncoding.FLOAT32, word_timings=True)):
            if isinstance(event, AudioOut):
                words.extend(event.words)
                total = max(total, event.offset_samples + event.num_samples)
    assert [w.word for w in words] == ["One", "two", "three", "Four", "five"]
    ends = [0]
    for w in words:
        assert ends[-1] <= w.start < w.end <= total
        ends.append(w.end)
    # The second sentence's words start after the first sentence's audio.
    assert words[3].start > words[2].end
    # ... and within each sentence they are the runtime's spans from the predicted durations.
    first, second = utterances(builtin_ort, text, 5)
    assert [(w.start, w.end) for w in words[:3]] == [(s, e) for _, s, e in first.word_spans]
    assert all(0 <= s < e <= first.frames * builtin_ort.hop for _, s, e in first.word_spans)
    assert [w.end - w.start for w in words[3:]] == [e - s for _, s, e in second.word_spans]


def test_builtin_voice_end_to_end_is_speech(builtin_ort: VitsRuntime) -> None:
    """Real voice: non-silent, plausible length, and recognisable by an ASR."""
    text = "The weather today is sunny and warm."
    audio = np.concatenate(references(builtin_ort, text, seed=1))
    seconds = len(audio) / builtin_ort.sample_rate
    assert 1.2 < seconds < 4.5  # ~ 8-9 phonemes per second of speech
    assert float(np.sqrt(np.mean(audio**2))) > 0.02
    hyp = transcribe(audio, builtin_ort.sample_rate)
    ref = text.lower().rstrip(".").split()
    assert word_error_rate(ref, hyp) < 0.5, hyp




def test_batched_acoustic_stage_keeps_every_duration(builtin_ort: VitsRuntime) -> None:
    """Sentences batched together get exactly the durations they get alone."""
    from service.tools.voice_check import check_sentences

    params = SynthesisParams(seed=21)
    sentences = [s for t in check_sentences() for s in builtin_ort.voice.frontend.sentences(t) if s.phoneme_ids]

    def jobs() -> list[AcousticJob]:
        return [AcousticJob(s, None, params, utterance_rng(21, s.phoneme_ids)) for s in sentences]

    together = builtin_ort.acoustic_batch(jobs())
    alone = [builtin_ort.acoustic_batch([job])[0] for job in jobs()]
    for a, b in zip(together, alone, strict=True):
        assert np.array_equal(a.durations, b.durations)
        assert np.abs(a.prior.full() - b.prior.full()).max() < 1e-3


def test_ceil_ambiguity_is_detected(builtin_ort: VitsRuntime) -> None:
    near = np.log(np.array([3.0000004, 5.5], dtype=np.float64)).astype(np.float32)
    far = np.log(np.array([3.4, 5.5], dtype=np.float64)).astype(np.float32)
    assert builtin_ort.ceil_is_ambiguous(near, SynthesisParams())
    assert not builtin_ort.ceil_is_ambiguous(far, SynthesisParams())


def test_prior_sample_drawn_in_pieces_equals_drawn_whole(builtin_ort: VitsRuntime) -> None:
    """Decoder steps draw the prior on the device, a few frames at a time; the host draws it
    whole. Any split gives the same sample, so step sizes and batching never change the audio."""
    import torch

    from service.models.noise import counter_normal

    params = SynthesisParams(seed=5)
    (sentence,) = builtin_ort.voice.frontend.sentences("A sentence long enough for several decoder steps.")

    def utt(seed: int) -> Utterance:
        job = AcousticJob(sentence, None, params, utterance_rng(seed, sentence.phoneme_ids))
        return builtin_ort.acoustic_batch([job])[0]

    a = utt(5)
    whole = a.prior.full()
    assert np.array_equal(utt(5).prior.full(), whole)  # same seed, same sample
    pieces, lo = [], 0
    for step in (77, 1, 32, 5, 32, 1000):
        mean, sigma = a.prior.parts(lo, lo + step)
        n = mean.shape[1]
        assert n == max(0, min(step, a.frames - lo))
        noise = counter_normal(torch.tensor([a.prior.key]), torch.tensor([lo]), a.prior.channels, n).numpy()
        pieces.append(mean + sigma * noise[0])
        lo += step
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), whole, atol=1e-6, rtol=0)
    # the noise is there (not just the mean), drawn from the sentence's own seed
    other = utt(6)
    n = min(other.frames, a.frames)
    assert np.abs(other.prior.full()[:, :n] - whole[:, :n]).max() > 0.1
    assert other.prior.key != a.prior.key


def test_counter_noise_is_standard_normal_and_independent() -> None:
    import torch

    from service.models.noise import counter_normal

    x = counter_normal(torch.tensor([1, 2, 3, 1 << 62]), torch.tensor([0, 0, 7, 10**6]), 192, 400).numpy()
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1.0) < 0.01
    assert np.isfinite(x).all() and float(np.abs(x).max()) < 6.0
    flat = x.reshape(4, -1)
    assert abs(np.corrcoef(flat[0], flat[1])[0, 1]) < 0.02  # keys are independent
    assert abs(np.corrcoef(x[0, :-1].ravel(), x[0, 1:].ravel())[0, 1]) < 0.02  # neighbouring channels
    assert abs(np.corrcoef(x[0, :, :-1].ravel(), x[0, :, 1:].ravel())[0, 1]) < 0.02  # neighbouring frames
    shifted = counter_normal(torch.tensor([3]), torch.tensor([0]), 192, 407).numpy()
    assert np.array_equal(shifted[0, :, 7:], x[2])  # a frame's noise depends on its index only
