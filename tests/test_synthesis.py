"""Chunked streaming synthesis: exactness against a full decode, seams, seeds,
controls and word timings, on both CPU backends."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.synthesis import ChunkSchedule, SynthesisParams, Synthesizer, open_synthesizer

TEXT = "Hello there, this is a test of chunked decoding. It has two sentences!"
SCHEDULES = [
    ChunkSchedule(first_frames=1, growth=1.0, max_frames=1),
    ChunkSchedule(first_frames=3, growth=2.0, max_frames=16),
    ChunkSchedule(first_frames=8, growth=4.0, max_frames=256),
    ChunkSchedule(first_frames=5, growth=1.5, max_frames=7),
]
FULL = ChunkSchedule(first_frames=1 << 20, growth=1.0, max_frames=1 << 20)


def synth(path: Path | None, backend: str, schedule: ChunkSchedule, cache: str) -> Synthesizer:
    return open_synthesizer(str(path) if path else None, backend=backend, schedule=schedule, cache_dir=cache)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_chunked_equals_full_decode(tiny_voice_path: Path, onnx_cache_dir: str, backend: str) -> None:
    params = SynthesisParams(seed=7, speaker=1)
    full, _ = synth(tiny_voice_path, backend, FULL, onnx_cache_dir).synthesize(TEXT, params)
    for schedule in SCHEDULES:
        chunked, _ = synth(tiny_voice_path, backend, schedule, onnx_cache_dir).synthesize(TEXT, params)
        assert chunked.shape == full.shape
        # Scale-free check: the tiny voice is quiet, so compare relative to its peak.
        peak = float(np.abs(full).max())
        assert float(np.abs(chunked - full).max()) <= 1e-4 * max(peak, 1e-3), schedule


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_builtin_voice_chunks_equal_full_decode(onnx_cache_dir: str, backend: str) -> None:
    params = SynthesisParams(seed=3)
    text = "Streaming keeps the seams invisible."
    full_syn = synth(None, backend, FULL, onnx_cache_dir)
    full, _ = full_syn.synthesize(text, params)
    syn = synth(None, backend, ChunkSchedule(first_frames=8, growth=2.0, max_frames=32), onnx_cache_dir)
    pieces = [c.samples for c in syn.stream(text, params)]
    chunked = np.concatenate(pieces)
    assert len(pieces) > 3
    assert float(np.abs(chunked - full).max()) <= 1e-4
    # No clicks: the jump between neighbouring samples at every seam is what the
    # full decode has at the same place (up to the exactness tolerance).
    seams = np.cumsum([len(p) for p in pieces])[:-1]
    for s in seams:
        assert abs(abs(chunked[s] - chunked[s - 1]) - abs(full[s] - full[s - 1])) <= 2e-4


def test_onnxruntime_stages_reproduce_torch(onnx_cache_dir: str) -> None:
    from service.audio.quality import psnr_db

    params = SynthesisParams(seed=11)
    text = "The exported stage graphs compute the same function."
    a, _ = synth(None, "torch", ChunkSchedule(), onnx_cache_dir).synthesize(text, params)
    b, _ = synth(None, "onnxruntime", ChunkSchedule(), onnx_cache_dir).synthesize(text, params)
    assert len(a) == len(b)
    assert psnr_db(a, b) >= 60.0


def test_same_seed_same_samples_other_seed_differs(tiny_voice_path: Path, onnx_cache_dir: str) -> None:
    syn = synth(tiny_voice_path, "onnxruntime", ChunkSchedule(), onnx_cache_dir)
    a, _ = syn.synthesize(TEXT, SynthesisParams(seed=1))
    b, _ = syn.synthesize(TEXT, SynthesisParams(seed=1))
    c, _ = syn.synthesize(TEXT, SynthesisParams(seed=2))
    assert np.array_equal(a, b)
    assert len(a) != len(c) or not np.array_equal(a, c)


def test_length_scale_changes_duration(builtin_ort: Synthesizer) -> None:
    text = "Speaking rate is a length scale."
    normal, _ = builtin_ort.synthesize(text, SynthesisParams(seed=4, noise_w=0.0))
    slow, _ = builtin_ort.synthesize(text, SynthesisParams(seed=4, noise_w=0.0, length_scale=1.5))
    assert 1.3 < len(slow) / len(normal) < 1.7


def test_unknown_speaker_is_an_error(tiny_voice_path: Path, onnx_cache_dir: str) -> None:
    syn = synth(tiny_voice_path, "onnxruntime", ChunkSchedule(), onnx_cache_dir)
    with pytest.raises(LookupError, match=r"speakers 0\.\.2"):
        syn.synthesize("hi", SynthesisParams(speaker=7))
    with pytest.raises(LookupError, match="no speaker 'dave'"):
        syn.synthesize("hi", SynthesisParams(speaker="dave"))
    a, _ = syn.synthesize("hi", SynthesisParams(speaker="bob", seed=1))
    b, _ = syn.synthesize("hi", SynthesisParams(speaker=1, seed=1))
    assert np.array_equal(a, b)


def test_word_timings_follow_durations(builtin_ort: Synthesizer) -> None:
    text = "One two three. Four five!"
    audio, words = builtin_ort.synthesize(text, SynthesisParams(seed=5))
    assert [w.word for w in words] == ["One", "two", "three", "Four", "five"]
    ends = [0]
    for w in words:
        assert ends[-1] <= w.start < w.end <= len(audio)
        ends.append(w.end)
    # The second sentence's words start after the first sentence's audio.
    assert words[3].start > words[2].end


def test_builtin_voice_end_to_end_is_speech(builtin_ort: Synthesizer) -> None:
    """Real voice: non-silent, plausible length, and recognisable by an ASR."""
    import soxr
    from pocketsphinx import Decoder

    text = "The weather today is sunny and warm."
    audio, _ = builtin_ort.synthesize(text, SynthesisParams(seed=1))
    seconds = len(audio) / builtin_ort.sample_rate
    assert 1.2 < seconds < 4.5  # ~ 8-9 phonemes per second of speech
    assert float(np.sqrt(np.mean(audio**2))) > 0.02
    pcm = (np.clip(soxr.resample(audio, builtin_ort.sample_rate, 16000), -1, 1) * 32767).astype(np.int16)
    decoder = Decoder(samprate=16000)
    decoder.start_utt()
    decoder.process_raw(pcm.tobytes(), full_utt=True)
    decoder.end_utt()
    hyp = decoder.hyp().hypstr.lower().split() if decoder.hyp() else []
    ref = text.lower().rstrip(".").split()
    assert word_error_rate(ref, hyp) < 0.5, hyp


def word_error_rate(ref: list[str], hyp: list[str]) -> float:
    d = np.zeros((len(ref) + 1, len(hyp) + 1), dtype=int)
    d[:, 0] = np.arange(len(ref) + 1)
    d[0, :] = np.arange(len(hyp) + 1)
    for i in range(1, len(ref) + 1):
        for j in range(1, len(hyp) + 1):
            d[i, j] = min(d[i - 1, j] + 1, d[i, j - 1] + 1, d[i - 1, j - 1] + (ref[i - 1] != hyp[j - 1]))
    return float(d[-1, -1]) / max(len(ref), 1)


def test_batched_acoustic_stage_keeps_every_duration(builtin_ort: Synthesizer) -> None:
    """Sentences batched together get exactly the durations they get alone."""
    from service.synthesis import AcousticJob, utterance_rng
    from service.tools.voice_check import check_sentences

    params = SynthesisParams(seed=21)
    sentences = [s for t in check_sentences() for s in builtin_ort.voice.frontend.sentences(t) if s.phoneme_ids]

    def jobs() -> list[AcousticJob]:
        return [AcousticJob(s, None, params, utterance_rng(21, s.phoneme_ids)) for s in sentences]

    together = builtin_ort.acoustic_batch(jobs())
    alone = [builtin_ort.acoustic_batch([job])[0] for job in jobs()]
    for a, b in zip(together, alone, strict=True):
        assert np.array_equal(a.durations, b.durations)
        assert np.abs(a.z_p - b.z_p).max() < 1e-3


def test_ceil_ambiguity_is_detected(builtin_ort: Synthesizer) -> None:
    near = np.log(np.array([3.0000004, 5.5], dtype=np.float64)).astype(np.float32)
    far = np.log(np.array([3.4, 5.5], dtype=np.float64)).astype(np.float32)
    assert builtin_ort._ceil_is_ambiguous(near, SynthesisParams())
    assert not builtin_ort._ceil_is_ambiguous(far, SynthesisParams())


def test_prior_sample_drawn_in_pieces_equals_drawn_whole(builtin_ort: Synthesizer) -> None:
    """Decoder steps draw the prior on the device, a few frames at a time; the host draws it
    whole. Any split gives the same sample, so step sizes and batching never change the audio."""
    import torch

    from service.models.noise import counter_normal
    from service.synthesis import AcousticJob, utterance_rng

    params = SynthesisParams(seed=5)
    (sentence,) = builtin_ort.voice.frontend.sentences("A sentence long enough for several decoder steps.")

    def utt(seed: int):  # type: ignore[no-untyped-def]
        job = AcousticJob(sentence, None, params, utterance_rng(seed, sentence.phoneme_ids))
        return builtin_ort.acoustic_batch([job])[0]

    a = utt(5)
    whole = a.z_p
    assert np.array_equal(utt(5).z_p, whole)  # same seed, same sample
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
    assert np.abs(other.z_p[:, :n] - whole[:, :n]).max() > 0.1
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
