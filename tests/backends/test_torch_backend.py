"""The torch backend's FP16 twin: pins, memory, quality, guard and fallback (CPU here;
the same code runs on CUDA, see tests marked gpu)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from service.audio.encoding import AudioEncoding
from service.audio.quality import psnr_db
from service.engine.config import BatchConfig, EngineConfig
from service.engine.contract import AudioOut, Precision, SessionConfig
from service.engine.faults import inject_nonfinite
from service.engine.frontend_pool import FrontendPoolConfig
from service.engine.local import LocalEngine
from service.models.family import AcousticJob, ChunkSchedule, SynthesisParams, utterance_rng
from service.models.vits.backends.torch_backend import TorchBackend
from service.models.vits.precision import VITS_FP32_PINS, pinned_modules
from service.models.vits.runtime import Utterance, VitsRuntime
from service.models.vits.voice import Voice, builtin_voice_info

TEXT = "Half precision with pinned layers."  # one sentence: the engine serves it as one utterance
DATA = Path(__file__).resolve().parent.parent / "data"
SCHEDULE = ChunkSchedule(first_frames=8, growth=2.0, max_frames=64)


@pytest.fixture(scope="module")
def builtin_torch() -> VitsRuntime:
    voice = Voice(builtin_voice_info())
    return VitsRuntime(voice, TorchBackend(voice), SCHEDULE)


def open_engine(device: str = "cpu", voice: str | None = None, schedule: ChunkSchedule = SCHEDULE,
                shadow_fraction: float = 0.0, graphs: bool = True) -> LocalEngine:
    """The engine the server runs (torch, slot decoder), in this process: FP16 chunks are only
    made by its steps, with the guard and the FP32 redo around them. `graphs=False`: eager steps
    (a fault injected by a forward hook runs only there: a CUDA graph replay runs no Python)."""
    return LocalEngine(EngineConfig(
        voice=voice, voices_dir=DATA if voice else None, backend="torch", device=device, threads=1, cache_bytes=0,
        frontend=FrontendPoolConfig(workers=0), core="thread", schedule=schedule,
        batch=BatchConfig(decoder="slots", step_frames=schedule.max_frames, cuda_graphs=graphs),
        warmup_text="Warm up.",
        shadow_fraction=shadow_fraction,
    ))


def served(local: LocalEngine, text: str, precision: Precision, seed: int) -> list[AudioOut]:
    """The audio events of one session (float32 samples)."""
    config = SessionConfig(seed=seed, encoding=AudioEncoding.FLOAT32, precision=precision)
    return [e for e in local.stream(text, config) if isinstance(e, AudioOut) and e.num_samples]


def samples(events: list[AudioOut]) -> np.ndarray:
    return np.concatenate([np.frombuffer(e.audio, dtype="<f4") for e in events])


def utterance(runtime: VitsRuntime, text: str, seed: int) -> Utterance:
    """`text` (one sentence) through the acoustic stage with the noise the engine gives it."""
    (sentence,) = runtime.voice.frontend.sentences(text)
    job = AcousticJob(sentence, None, SynthesisParams(seed=seed), utterance_rng(seed, sentence.phoneme_ids))
    return runtime.acoustic_batch([job])[0]


def engine_backend(local: LocalEngine) -> TorchBackend:
    """The backend the engine's own runtime runs on (the one its steps use)."""
    (runtime,) = local.engine.host.runtimes.loaded.values()  # type: ignore[attr-defined]
    backend = runtime.backend
    assert isinstance(backend, TorchBackend)
    return backend


@pytest.fixture(scope="module")
def builtin_engine() -> Iterator[LocalEngine]:
    with open_engine() as local:
        yield local


def test_pinned_modules_stay_fp32(builtin_torch: VitsRuntime) -> None:
    backend = builtin_torch.backend
    assert isinstance(backend, TorchBackend)
    half = backend.model_for("fp16")
    # The built-in voice has one speaker (no emb_g); the acoustic stage runs on the FP32 model.
    assert pinned_modules(half, VITS_FP32_PINS) == ["dec.conv_post"]
    assert half.dec.conv_post.weight.dtype == torch.float32
    assert backend.model_for("fp32").enc_p.encoder.ffn_layers[0].conv_1.weight.dtype == torch.float32
    assert half.dec.ups[0].weight.dtype == torch.float16
    assert half.flow.flows["0"].enc.in_layers[0].weight.dtype == torch.float16


def test_fp16_vocoder_stages_hold_half_the_weight_memory(builtin_torch: VitsRuntime) -> None:
    backend = builtin_torch.backend
    assert isinstance(backend, TorchBackend)

    def stage_bytes(precision: str) -> int:
        m = backend.model_for(precision)
        return sum(p.numel() * p.element_size() for mod in (m.flow, m.dec) for p in mod.parameters())

    assert stage_bytes("fp16") <= 0.55 * stage_bytes("fp32")
    assert backend.weight_bytes("fp16") < backend.weight_bytes("fp32")


def test_fp16_audio_is_close_to_fp32(builtin_torch: VitsRuntime, builtin_engine: LocalEngine) -> None:
    """The FP16 chunks the engine serves against the FP32 reference decode of the same seeded
    sentence; and the FP16 reference decode against the FP32 one."""
    utt = utterance(builtin_torch, TEXT, 2)
    ref = builtin_torch.reference(utt, "fp32")
    events = served(builtin_engine, TEXT, Precision.FP16, 2)
    out = samples(events)
    assert len(events) > 1  # chunked
    assert {e.precision for e in events} == {Precision.FP16} and not any(e.fallback for e in events)
    assert len(out) == len(ref)
    assert psnr_db(ref, out) >= 45.0
    assert psnr_db(ref, builtin_torch.reference(utt, "fp16")) >= 45.0


@pytest.mark.parametrize("layer", ["dec.resblocks.4", "flow.flows.4.enc"])
def test_fault_injection_falls_back_to_fp32(builtin_torch: VitsRuntime, builtin_engine: LocalEngine,
                                            layer: str) -> None:
    # A quarter of the layer's output columns: in a slot step the first columns of a flow layer's
    # output are left context, cut away before the audio (measured: with 0.1 the flow fault fires
    # on every step and never reaches a sample), so a tenth would not test the guard there.
    fault = inject_nonfinite(engine_backend(builtin_engine).model_for("fp16"), layer, value=float("inf"),
                             fraction=0.25)
    try:
        events = served(builtin_engine, TEXT, Precision.FP16, 2)
    finally:
        fault.remove()
    ref = builtin_torch.reference(utterance(builtin_torch, TEXT, 2), "fp32")
    out = samples(events)
    assert fault.fired >= 1
    assert events[0].fallback and events[0].precision is Precision.FP32
    # the rest of the utterance in FP32
    assert all(e.precision is Precision.FP32 and not e.fallback for e in events[1:])
    assert np.isfinite(out).all() and len(out) == len(ref)
    assert psnr_db(ref, out) >= 60.0


def test_shadow_verification_measures_fp16_quality() -> None:
    """Every FP16 chunk the engine serves (shadow fraction 1) is checked against the FP32
    reference decode on the engine thread, off the serving path."""
    schedule = ChunkSchedule(first_frames=4, growth=2.0, max_frames=16)
    with open_engine(voice="tiny-multi", schedule=schedule, shadow_fraction=1.0) as local:
        shadow = local.engine.host.shadow  # type: ignore[attr-defined]
        assert shadow is not None

        def settled() -> tuple[int, int]:
            deadline = time.monotonic() + 60
            while shadow.pending and time.monotonic() < deadline:  # the idle engine thread verifies them
                time.sleep(0.01)
            assert not shadow.pending
            return shadow.verified, shadow.psnr.count

        verified, counted = settled()  # the warm-up's FP16 chunks, if it made any
        events = served(local, "Shadow checks every chunk here.", Precision.FP16, 1)
        now_verified, now_counted = settled()
    assert len(events) > 3 and all(e.precision is Precision.FP16 for e in events)
    assert shadow.dropped == 0
    assert now_verified - verified == len(events) == now_counted - counted
    snap = shadow.psnr.snapshot()
    assert snap["min"] is not None and float(snap["min"]) > 30.0  # type: ignore[arg-type]


def test_unknown_precision_is_rejected(builtin_torch: VitsRuntime) -> None:
    backend = builtin_torch.backend
    assert isinstance(backend, TorchBackend)
    with pytest.raises(ValueError, match="unknown precision 'bf8'"):
        backend.model_for("bf8")


@pytest.mark.gpu
def test_cuda_fp16_matches_fp32() -> None:
    voice = Voice(builtin_voice_info())
    backend = TorchBackend(voice, device="cuda")
    rng = np.random.default_rng(0)
    z = rng.standard_normal((4, voice.model.hp.inter_channels, 40)).astype(np.float32)
    ref = backend.vocode(z, None, "fp32").audio
    alone = np.concatenate([backend.vocode(z[i : i + 1], None, "fp32").audio for i in range(4)])
    assert np.allclose(ref, alone, atol=1e-5)  # a row's audio does not depend on its batch
    half = backend.vocode(z, None, "fp16")
    assert int(half.nonfinite.sum()) == 0
    for row in range(4):
        assert psnr_db(ref[row], half.audio[row]) >= 40.0


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["dec.resblocks.4", "flow.flows.4.enc"])
def test_cuda_fault_injection_falls_back_to_fp32(layer: str) -> None:
    voice = Voice(builtin_voice_info())
    runtime = VitsRuntime(voice, TorchBackend(voice, device="cuda"), SCHEDULE)
    ref = runtime.reference(utterance(runtime, TEXT, 2), "fp32")
    with open_engine(device="cuda", graphs=False) as local:
        fault = inject_nonfinite(engine_backend(local).model_for("fp16"), layer, value=float("nan"), fraction=0.25)
        try:
            events = served(local, TEXT, Precision.FP16, 2)
        finally:
            fault.remove()
    out = samples(events)
    assert fault.fired >= 1 and events[0].fallback
    assert np.isfinite(out).all() and len(out) == len(ref)
    assert psnr_db(ref, out) >= 60.0


@pytest.mark.gpu
def test_cuda_encoder_graphs_equal_the_eager_acoustic_stage() -> None:
    """The acoustic stage replayed from a CUDA graph (rows and phonemes padded to a bucket)
    gives the eager stage's outputs for every real row, and both agree with the CPU model
    (torch's own convolutions: the CUDA backend runs them as matrix products)."""
    import copy

    cpu_model = copy.deepcopy(Voice(builtin_voice_info()).model).cpu().eval()
    backend = TorchBackend(Voice(builtin_voice_info()), device="cuda")
    rng = np.random.default_rng(0)
    lengths = np.asarray([37, 12, 50], dtype=np.int64)
    ids = np.zeros((3, 50), dtype=np.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(1, 100, n)
    noise = rng.standard_normal((3, 2, 50)).astype(np.float32) * 0.8
    graphed = backend.encode(ids, lengths, noise, None)
    assert backend._encoder_graphs is not None and backend._encoder_graphs._graphs  # it ran from a graph
    backend._encoder_graphs = None
    eager = backend.encode(ids, lengths, noise, None)
    with torch.inference_mode():
        ref = cpu_model.encode(torch.as_tensor(ids), torch.as_tensor(lengths), torch.as_tensor(noise))
    for a, b, c in ((graphed.m_p, eager.m_p, ref[0]), (graphed.logs_p, eager.logs_p, ref[1]),
                    (graphed.logw, eager.logw, ref[2])):
        assert a.shape == b.shape
        for i, n in enumerate(lengths):
            np.testing.assert_allclose(a[i, :, :n], b[i, :, :n], atol=1e-4, rtol=1e-4)
            np.testing.assert_allclose(a[i, :, :n], c.numpy()[i, :, :n], atol=1e-3, rtol=1e-3)


def test_gemm_convolutions_equal_the_library_ones() -> None:
    """The acoustic stage's convolutions as matrix products (what the CUDA backend runs) give
    what torch's own convolutions give, padded, dilated and depthwise ones included."""
    import copy

    from service.models.vits.backends.torch_backend import gemm_convs

    model = Voice(builtin_voice_info()).model.eval()
    gemm = copy.deepcopy(model)
    gemm_convs(gemm.enc_p)
    gemm_convs(gemm.dp)
    replaced = [m for m in gemm.modules() if isinstance(m, torch.nn.Conv1d) and "forward" in vars(m)]
    assert len(replaced) > 20 and any(m.groups > 1 for m in replaced) and any(m.dilation[0] > 1 for m in replaced)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (4, 90), generator=gen)
    lengths = torch.tensor([90, 61, 33, 7])
    noise = torch.randn(4, 2, 90, generator=gen) * 0.8
    with torch.inference_mode():
        want, got = model.encode(ids, lengths, noise), gemm.encode(ids, lengths, noise)
    for a, b in zip(want[:3], got[:3], strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), atol=1e-4, rtol=0)



def _area(rows: int, longest: int) -> float:
    """A stand-in for measured device times: padded rows x padded phonemes, plus a fixed cost."""
    bucket = next(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b >= rows)
    return bucket * (-(-longest // 32) * 32) + 500.0


def test_split_batch_pads_little_and_keeps_one_call_where_padding_is_cheap() -> None:
    from service.models.vits.backends.torch_backend import split_batch

    sizes = (1, 2, 4, 8, 16, 32, 64, 128)
    assert split_batch([100] * 64, _area, sizes) == [64]  # equal lengths: one call
    assert split_batch([32] * 32 + [480] * 32, _area, sizes) == [32, 32]  # short ones not padded to 480
    assert sum(split_batch([100] * 45, _area, sizes)) == 45
    assert len(split_batch([100] * 45, _area, sizes)) > 1  # 45 rows are not padded to 64
    assert split_batch([100, 600], lambda r, n: None if n > 512 else _area(r, n), sizes) == [2]  # unpriced: whole
    assert split_batch([], _area, sizes) == []


@given(st.lists(st.integers(1, 512), min_size=1, max_size=10), st.floats(0, 5000))
@settings(max_examples=200, deadline=None)
def test_split_batch_finds_the_cheapest_grouping(lengths: list[int], fixed: float) -> None:
    """Against every way to cut the (sorted) batch into consecutive groups of the sizes tried."""
    import itertools

    from service.models.vits.backends.torch_backend import split_batch

    lengths.sort()
    sizes = (1, 2, 4, 8)

    def cost(rows: int, longest: int) -> float:
        return _area(rows, longest) - 500.0 + fixed

    def total(groups: list[int]) -> float:
        out, start = 0.0, 0
        for g in groups:
            out += cost(g, lengths[start + g - 1])
            start += g
        return out

    n = len(lengths)
    best = math.inf
    for cuts in itertools.product([False, True], repeat=n - 1):
        groups, size = [], 1
        for cut in cuts:
            if cut:
                groups.append(size)
                size = 0
            size += 1
        groups.append(size)
        if all(g in sizes for g in groups[1:]):  # the shortest sentences may also go all at once
            best = min(best, total(groups))
    got = split_batch(lengths, cost, sizes)
    assert sum(got) == n and all(g in sizes for g in got[1:])
    assert total(got) == pytest.approx(best)


def test_an_acoustic_batch_split_by_the_backend_keeps_every_utterance_in_order(
    builtin_torch: VitsRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the backend runs a batch as several calls (`acoustic_split`: by length on CUDA),
    each job still gets its own utterance, in the order given: the durations it gets in one call
    and, to rounding, the same prior."""
    from service.tools.voice_check import check_sentences

    params = SynthesisParams(seed=5)
    sentences = [s for t in check_sentences()[:4] for s in builtin_torch.voice.frontend.sentences(t) if s.phoneme_ids]
    assert len({len(s.phoneme_ids) for s in sentences}) > 3

    def jobs() -> list[AcousticJob]:
        return [AcousticJob(s, None, params, utterance_rng(5, s.phoneme_ids)) for s in sentences]

    whole = builtin_torch.acoustic_batch(jobs())
    seen: list[list[int]] = []

    def split(lengths: list[int]) -> list[int]:
        seen.append(list(lengths))
        return [1, 2, len(lengths) - 3]

    monkeypatch.setattr(builtin_torch.backend, "acoustic_split", split, raising=False)
    monkeypatch.setattr(builtin_torch, "capabilities",
                        dataclasses.replace(builtin_torch.capabilities, acoustic_split=True))
    parts = builtin_torch.acoustic_batch(jobs())
    assert seen == [sorted(len(s.phoneme_ids) for s in sentences)]  # asked with ascending lengths
    for s, a, b in zip(sentences, whole, parts, strict=True):
        assert b.phoneme_ids == list(s.phoneme_ids)
        assert np.array_equal(a.durations, b.durations)
        np.testing.assert_allclose(a.prior.mean, b.prior.mean, atol=1e-5)


@pytest.mark.gpu
def test_cuda_acoustic_batches_split_by_measured_device_time_keep_every_duration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA every encoder graph's device time is measured at capture and a batch of mixed
    lengths runs as the cheapest groups by it; the utterances are those of one call."""
    from service.tools.bench_load import SENTENCES

    voice = Voice(builtin_voice_info())
    backend = TorchBackend(voice, device="cuda")
    backend.capture_encoder(64)
    graphs = backend._encoder_graphs
    assert graphs is not None and len(graphs.device_ms) == len(graphs._graphs) and min(graphs.device_ms.values()) > 0
    synth = VitsRuntime(voice, backend, ChunkSchedule())
    sentences = [s for t in SENTENCES for s in voice.frontend.sentences(t) if s.phoneme_ids]
    sentences = (sentences * 4)[:45]
    params = SynthesisParams(seed=9)

    def jobs() -> list[AcousticJob]:
        return [AcousticJob(s, None, params, utterance_rng(9, s.phoneme_ids)) for s in sentences]

    sizes = backend.acoustic_split(sorted(len(s.phoneme_ids) for s in sentences))
    assert sum(sizes) == 45 and len(sizes) > 1  # 45 mixed lengths: not one call padded to 64 rows
    parts = synth.acoustic_batch(jobs())
    monkeypatch.setattr(backend, "acoustic_split", lambda lengths: [len(lengths)])
    whole = synth.acoustic_batch(jobs())
    for a, b in zip(whole, parts, strict=True):
        assert np.array_equal(a.durations, b.durations)
        np.testing.assert_allclose(a.prior.mean, b.prior.mean, atol=1e-4)


@pytest.mark.gpu
def test_cuda_compiled_acoustic_stage_keeps_every_duration() -> None:
    """`compile_acoustic`: the stage's graphs hold inductor's kernels (compiled, not fallen back
    to eager) and give the eager graphs' utterances: the same durations for every sentence, at a
    batch of one and of many, and priors to FP32 rounding."""
    from service.tools.bench_load import SENTENCES

    voice = Voice(builtin_voice_info())
    sentences = [s for t in SENTENCES for s in voice.frontend.sentences(t) if s.phoneme_ids]
    sentences = (sentences * 4)[:45]
    params = SynthesisParams(seed=3)

    def utterances(backend: TorchBackend, batch: list) -> list:  # type: ignore[type-arg]
        synth = VitsRuntime(voice, backend, ChunkSchedule())
        return synth.acoustic_batch([AcousticJob(s, None, params, utterance_rng(3, s.phoneme_ids)) for s in batch])

    eager = TorchBackend(voice, device="cuda")
    compiled = TorchBackend(voice, device="cuda", compile_acoustic=True)
    graphs = compiled._encoder_graphs
    assert graphs is not None
    for batch in (sentences[:1], sentences):
        for a, b in zip(utterances(eager, batch), utterances(compiled, batch), strict=True):
            assert np.array_equal(a.durations, b.durations)
            np.testing.assert_allclose(a.prior.mean, b.prior.mean, atol=1e-4)
    assert graphs._graphs and graphs._encode.compiled  # it ran compiled
