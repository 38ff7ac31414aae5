"""The torch backend's FP16 twin: pins, memory, quality, guard and fallback (CPU here;
the same code runs on CUDA, see tests marked gpu)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from service.audio.quality import psnr_db
from service.backends.torch_backend import TorchBackend
from service.engine.faults import inject_nonfinite
from service.engine.shadow import ShadowVerifier
from service.models.vits.precision import VITS_FP32_PINS, pinned_modules
from service.synthesis import ChunkSchedule, SynthesisParams, Synthesizer
from service.voices import Voice, VoiceInfo, builtin_voice_info

TEXT = "Half precision with pinned layers."


@pytest.fixture(scope="module")
def builtin_torch() -> Synthesizer:
    voice = Voice(builtin_voice_info())
    return Synthesizer(voice, TorchBackend(voice), ChunkSchedule(first_frames=8, growth=2.0, max_frames=64))


def test_pinned_modules_stay_fp32(builtin_torch: Synthesizer) -> None:
    backend = builtin_torch.backend
    assert isinstance(backend, TorchBackend)
    half = backend.model_for("fp16")
    assert pinned_modules(half, VITS_FP32_PINS) == ["enc_p", "dp", "dec.conv_post"]
    assert half.dec.conv_post.weight.dtype == torch.float32
    assert half.enc_p.encoder.ffn_layers[0].conv_1.weight.dtype == torch.float32
    assert half.dec.ups[0].weight.dtype == torch.float16
    assert half.flow.flows["0"].enc.in_layers[0].weight.dtype == torch.float16


def test_fp16_vocoder_stages_hold_half_the_weight_memory(builtin_torch: Synthesizer) -> None:
    backend = builtin_torch.backend
    assert isinstance(backend, TorchBackend)

    def stage_bytes(precision: str) -> int:
        m = backend.model_for(precision)
        return sum(p.numel() * p.element_size() for mod in (m.flow, m.dec) for p in mod.parameters())

    assert stage_bytes("fp16") <= 0.55 * stage_bytes("fp32")
    assert backend.weight_bytes("fp16") < backend.weight_bytes("fp32")


def test_fp16_audio_is_close_to_fp32(builtin_torch: Synthesizer) -> None:
    ref, _ = builtin_torch.synthesize(TEXT, SynthesisParams(seed=2, precision="fp32"))
    chunks = list(builtin_torch.stream(TEXT, SynthesisParams(seed=2, precision="fp16")))
    out = np.concatenate([c.samples for c in chunks])
    assert {c.precision for c in chunks} == {"fp16"} and not any(c.fallback for c in chunks)
    assert len(out) == len(ref)
    assert psnr_db(ref, out) >= 45.0


@pytest.mark.parametrize("layer", ["dec.resblocks.4", "flow.flows.4.enc"])
def test_fault_injection_falls_back_to_fp32(builtin_torch: Synthesizer, layer: str) -> None:
    backend = builtin_torch.backend
    assert isinstance(backend, TorchBackend)
    fault = inject_nonfinite(backend.model_for("fp16"), layer, value=float("inf"), fraction=0.1)
    try:
        chunks = list(builtin_torch.stream(TEXT, SynthesisParams(seed=2, precision="fp16")))
    finally:
        fault.remove()
    ref, _ = builtin_torch.synthesize(TEXT, SynthesisParams(seed=2, precision="fp32"))
    out = np.concatenate([c.samples for c in chunks])
    assert fault.fired >= 1
    assert chunks[0].fallback and chunks[0].precision == "fp32"
    assert all(c.precision == "fp32" and not c.fallback for c in chunks[1:])  # rest of the utterance in FP32
    assert np.isfinite(out).all()
    assert psnr_db(ref, out) >= 60.0


def test_shadow_verification_measures_fp16_quality(tiny_voice_path: Path) -> None:
    voice = Voice(VoiceInfo.from_files(tiny_voice_path))
    shadow = ShadowVerifier(fraction=1.0)
    syn = Synthesizer(voice, TorchBackend(voice), ChunkSchedule(first_frames=4, growth=2.0, max_frames=16),
                      shadow=shadow)
    chunks = list(syn.stream("Shadow checks every chunk here.", SynthesisParams(seed=1, precision="fp16")))
    shadow.drain()
    snap = shadow.psnr.snapshot()
    assert shadow.verified == len(chunks) == snap["count"]
    assert snap["min"] is not None and float(snap["min"]) > 30.0  # type: ignore[arg-type]
    shadow.close()


def test_unknown_precision_is_rejected(builtin_torch: Synthesizer) -> None:
    backend = builtin_torch.backend
    assert isinstance(backend, TorchBackend)
    with pytest.raises(ValueError, match="unknown precision 'bf8'"):
        backend.model_for("bf8")


@pytest.mark.gpu
def test_cuda_fp16_matches_fp32_and_session_streams_agree() -> None:
    voice = Voice(builtin_voice_info())
    backend = TorchBackend(voice, device="cuda")
    rng = np.random.default_rng(0)
    z = rng.standard_normal((4, voice.model.hp.inter_channels, 40)).astype(np.float32)
    ref = backend.vocode(z, None, "fp32", sessions=[1, 2, 3, 4]).audio
    plain = TorchBackend(voice, device="cuda", stream_pool_size=1).vocode(z, None, "fp32").audio
    assert np.allclose(ref, plain, atol=1e-5)
    half = backend.vocode(z, None, "fp16", sessions=[1, 2, 3, 4])
    assert int(half.nonfinite.sum()) == 0
    for row in range(4):
        assert psnr_db(ref[row], half.audio[row]) >= 40.0


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["dec.resblocks.4", "flow.flows.4.enc"])
def test_cuda_fault_injection_falls_back_to_fp32(layer: str) -> None:
    voice = Voice(builtin_voice_info())
    syn = Synthesizer(voice, TorchBackend(voice, device="cuda"), ChunkSchedule(first_frames=8, growth=2.0,
                                                                               max_frames=64))
    backend = syn.backend
    assert isinstance(backend, TorchBackend)
    ref, _ = syn.synthesize(TEXT, SynthesisParams(seed=2, precision="fp32"))
    fault = inject_nonfinite(backend.model_for("fp16"), layer, value=float("nan"), fraction=0.1)
    try:
        chunks = list(syn.stream(TEXT, SynthesisParams(seed=2, precision="fp16")))
    finally:
        fault.remove()
    out = np.concatenate([c.samples for c in chunks])
    assert fault.fired >= 1 and chunks[0].fallback
    assert np.isfinite(out).all()
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

    from service.backends.torch_backend import gemm_convs

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

