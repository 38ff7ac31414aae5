"""The slot decoder: batched fixed-shape steps with per-session state equal a full decode."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from service.audio.quality import psnr_db
from service.models.family import AcousticJob, StepRows, SynthesisParams, utterance_rng
from service.models.registry import open_voice
from service.models.vits.model import VitsModel
from service.models.vits.runtime import PriorSample, Utterance, VitsRuntime
from service.models.vits.streaming import PriorMemory, VitsStreamingDecoder
from service.models.vits.voice import builtin_voice_info, read_piper_voice


def _runtime(voice: str | None) -> VitsRuntime:
    """A voice on the torch backend (CPU): `voice` a Piper .onnx path, None the built-in one."""
    info = read_piper_voice(Path(voice)) if voice else builtin_voice_info()
    return open_voice(info, "torch", "cpu")  # type: ignore[return-value]


def _prepare(runtime: VitsRuntime, text: str, params: SynthesisParams) -> list[Utterance]:
    """`text`'s sentences through the acoustic stage, each with its own seeded noise."""
    sid = runtime.info.speaker_index(params.speaker)
    sentences = [s for s in runtime.voice.frontend.sentences(text) if s.phoneme_ids]
    return runtime.acoustic_batch([AcousticJob(s, sid, params, utterance_rng(params.seed, s.phoneme_ids))
                                   for s in sentences])


def _utterances(voice: str | None, text: str, speaker: int | None) -> tuple[VitsModel, list[Utterance]]:
    runtime = _runtime(voice)
    return runtime.voice.model, _prepare(runtime, text, SynthesisParams(seed=7, speaker=speaker))


@torch.inference_mode()
def _full(model: VitsModel, u: Utterance, device: torch.device) -> np.ndarray:
    sid = None if u.sid is None else torch.tensor([u.sid], device=device)
    z_p = torch.from_numpy(u.prior.full())[None].to(device)
    z = model.flow_reverse(z_p, torch.ones(1, 1, z_p.shape[2], device=device), sid)
    return model.vocode(z, sid)[0].float().cpu().numpy()


def _stream_together(dec: VitsStreamingDecoder, utts: list[Utterance], slots: list[int],
                     sizes: list[int]) -> list[np.ndarray]:
    """Decode `utts` side by side, one batched step per size in `sizes` (then `sizes[-1]`
    until every utterance is out), each in its own slot."""
    for slot, u in zip(slots, utts, strict=True):
        assert dec.start(slot, u.prior)
    fed, pieces = 0, [[] for _ in utts]  # type: list[list[np.ndarray]]
    k = 0
    while any(fed - dec.lag < u.frames for u in utts):
        n = sizes[min(k, len(sizes) - 1)]
        sids = None if utts[0].sid is None else [u.sid or 0 for u in utts]
        audio = dec.step(StepRows(slots, [fed] * len(utts), n, sids))
        for i in range(len(utts)):
            pieces[i].append(audio[i].float().cpu().numpy())
        fed += n
        k += 1
    return [np.concatenate(p)[dec.lag * dec.hop :][: u.frames * dec.hop] for p, u in zip(pieces, utts, strict=True)]


@pytest.mark.parametrize("voice, speaker", [("tiny", 1), ("builtin", None)])
def test_batched_slot_steps_equal_full_decodes(voice: str, speaker: int | None, tiny_voice_path: Path) -> None:
    """Utterances of different lengths decoded together in odd-sized steps, from slots with
    stale state of earlier use, equal each utterance's full decode (the edges included)."""
    model, utts = _utterances(str(tiny_voice_path) if voice == "tiny" else None,
                              "Hello there, this is a streaming test. Short one. And a third sentence here.", speaker)
    assert len(utts) == 3 and len({u.frames for u in utts}) == 3
    # Just enough prior memory that the second pass (each slot freed as it is started again)
    # always fits, and reuses the first pass's blocks in another order.
    need = [-(-len(u.phoneme_ids) // PriorMemory.BLOCK) for u in utts]
    blocks = sum(need) + max(need)
    dec = VitsStreamingDecoder(model, "fp32", 6, torch.device("cpu"), torch.float32,
                               prior_columns=blocks * PriorMemory.BLOCK)
    _stream_together(dec, utts[::-1], [5, 0, 3], [40])  # leaves state behind in the slots
    out = _stream_together(dec, utts, [0, 3, 5], [13 + dec.lag, 13, 29])
    for u, audio in zip(utts, out, strict=True):
        full = _full(model, u, torch.device("cpu"))
        assert audio.shape == full.shape
        np.testing.assert_allclose(audio, full, atol=1e-4, rtol=0)


def test_a_slot_step_does_not_touch_other_slots(tiny_voice_path: Path) -> None:
    model, utts = _utterances(str(tiny_voice_path), "One sentence to decode.", 0)
    dec = VitsStreamingDecoder(model, "fp32", 4, torch.device("cpu"), torch.float32)
    for h in dec.history:
        h[2].fill_(0.5)
    _stream_together(dec, utts, [1], [20])
    for h in dec.history:
        assert torch.all(h[2] == 0.5) and torch.all(h[0] == 0) and torch.all(h[3] == 0)


# FP16 (with its FP32 pins) against FP32 on the GPU; README's Precision section gives the
# measured figures.
FP16_MIN_PSNR_DB = 50.0


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_cuda_graph_steps_equal_eager_steps_and_the_full_decode(precision: str) -> None:
    """On CUDA, steps replayed from captured graphs (padded to a bucket) give what eager steps
    give and equal the full decode in FP32; in FP16 (with its FP32 pins) both stay as close to
    it as FP16 rounding allows."""
    from service.models.vits.backends.torch_backend import TorchBackend
    from service.models.vits.voice import Voice

    backend = TorchBackend(Voice(builtin_voice_info()), device="cuda")
    utts = _prepare(_runtime(None), "Hello there, this is a streaming test. Short one. And a third sentence here.",
                    SynthesisParams(seed=7))
    lag = backend.streaming_lag()
    graphed = backend.streaming_decoder(precision, 8, max_rows=4, graph_frames=(20 + lag, 20))
    eager = backend.streaming_decoder(precision, 8, max_rows=4, graphs=False)
    a = _stream_together(graphed, utts, [0, 1, 2], [20 + lag, 20])
    b = _stream_together(eager, utts, [0, 1, 2], [20 + lag, 20])
    model = backend.models["fp32"]
    for u, x, y in zip(utts, a, b, strict=True):
        full = _full(model, u, torch.device("cuda"))
        figures = {"graph vs eager": psnr_db(y, x), "graph vs full FP32": psnr_db(full, x),
                   "eager vs full FP32": psnr_db(full, y)}
        print(f"{precision}, {u.frames} frames: " + ", ".join(f"{k} {v:.1f} dB" for k, v in figures.items()))
        if precision == "fp32":
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)
            assert np.abs(x - full).max() <= 1e-4
        else:
            # cuDNN picks FP16 kernels by timing them (cudnn.benchmark), per shape: the graph's
            # padded batch and the eager one may round differently, like any two FP16 kernels.
            assert min(figures.values()) >= FP16_MIN_PSNR_DB, figures


def _random_prior(rng: np.random.Generator, channels: int, key: int) -> PriorSample:
    phonemes, frames = int(rng.integers(1, 90)), int(rng.integers(1, 300))
    return PriorSample(rng.standard_normal((channels, phonemes)).astype(np.float32),
                       rng.random((channels, phonemes)).astype(np.float32),
                       np.sort(rng.integers(0, phonemes, frames)), key)


def test_prior_memory_gathers_each_slots_frames_through_reused_blocks() -> None:
    """Priors put, dropped and put again (some before the previous ones were written) land in
    scattered blocks; a step's columns still read exactly each row's frames (mean and sigma),
    and the zero column past the end. Host priors and device ones are written side by side."""
    rng = np.random.default_rng(11)
    channels, slots = 5, 6
    memory = PriorMemory(20 * PriorMemory.BLOCK, channels, slots, torch.device("cpu"))
    live: dict[int, PriorSample] = {}
    for key in range(120):
        slot = int(rng.integers(0, slots))
        if slot in live and rng.random() < 0.4:
            memory.drop(slot)
            del live[slot]
            continue
        prior = _random_prior(rng, channels, key)
        if rng.random() < 0.5:  # a prior the acoustic stage left on the device (here the CPU)
            prior = PriorSample.on_device(torch.from_numpy(np.stack([prior.mean, prior.sigma])), prior.src, key)
        if memory.put(slot, prior):
            live[slot] = prior
        else:
            live.pop(slot, None)  # a failed put leaves the slot empty (its old prior was dropped)
        if rng.random() < 0.5:
            continue  # several puts and drops between flushes: freed blocks are taken again first
        memory.flush(torch.from_numpy)
        rows = sorted(live)
        fed = [int(rng.integers(0, live[s].frames + 8)) for s in rows]
        frames = int(rng.integers(1, 70))
        cols = np.full((frames, len(rows) + 2), -1, dtype=np.int64)  # two padding rows
        memory.columns(rows, fed, frames, cols)
        got = memory.table[:, :, torch.from_numpy(cols)].permute(2, 3, 0, 1).numpy()  # [frames, rows, 2, C]
        assert not got[:, len(rows):].any()
        for i, s in enumerate(rows):
            mean, sigma = live[s].parts(fed[i], fed[i] + frames)
            n = mean.shape[1]
            assert np.array_equal(got[:n, i, 0].T, mean) and np.array_equal(got[:n, i, 1].T, sigma)
            assert not got[n:, i].any()
            assert memory.keys[s] == live[s].key and memory.lengths[s] == live[s].frames


def test_prior_memory_full_and_too_long() -> None:
    memory = PriorMemory(4 * PriorMemory.BLOCK, 3, 4, torch.device("cpu"))
    big = PriorSample.fixed(np.ones((3, 3 * PriorMemory.BLOCK), dtype=np.float32))
    assert memory.put(0, big)
    assert not memory.put(1, big)  # one block left: wait
    assert memory.lengths[1] == 0
    memory.drop(0)
    assert memory.put(1, big)
    with pytest.raises(ValueError, match="phoneme ids is longer than the decoder's prior memory"):
        memory.put(2, PriorSample.fixed(np.ones((3, 5 * PriorMemory.BLOCK), dtype=np.float32)))


def test_prior_memory_writes_only_live_priors() -> None:
    """A prior dropped before it was written is not written: its blocks may already hold
    another slot's prior (the table would get both, in no defined order on a GPU)."""
    memory = PriorMemory(4 * PriorMemory.BLOCK, 2, 4, torch.device("cpu"))
    a, b, c = (PriorSample.fixed(np.full((2, PriorMemory.BLOCK), v, dtype=np.float32)) for v in (1.0, 2.0, 3.0))
    assert memory.put(0, a) and memory.put(1, b)
    memory.drop(0)
    memory.drop(1)
    assert memory.put(0, c)  # takes the blocks b was given
    memory.flush(torch.from_numpy)
    cols = np.zeros((PriorMemory.BLOCK, 1), dtype=np.int64)
    memory.columns([0], [0], PriorMemory.BLOCK, cols)
    assert torch.all(memory.table[0, :, torch.from_numpy(cols[:, 0])] == 3.0)


def test_prior_memory_holds_256_phoneme_ids_per_slot_on_average(tiny_voice_path: Path) -> None:
    """README (How it works) sizes the prior table this way."""
    model, _ = _utterances(str(tiny_voice_path), "Sizing.", 0)
    dec = VitsStreamingDecoder(model, "fp16", 64, torch.device("cpu"), torch.float16)
    assert dec.prior.zero == 64 * 256 and dec.prior.table.dtype == torch.float32
    assert dec.prior.table.shape == (2, model.hp.inter_channels, 64 * 256 + 1)


def test_priors_left_on_the_device_decode_as_host_priors(tiny_voice_path: Path) -> None:
    """The acoustic stage may leave the prior where it was made (`encode_prior`, on a GPU): the
    same durations, mean and sigma (to exp's rounding), and the same audio from the slots."""
    runtime = _runtime(str(tiny_voice_path))
    text, params = "Hello there, this is a streaming test. Short one.", SynthesisParams(seed=7, speaker=1)
    host = _prepare(runtime, text, params)
    declared = runtime.capabilities
    runtime.capabilities = dataclasses.replace(declared, priors_on_device=True)
    try:
        device = _prepare(runtime, text, params)
    finally:
        runtime.capabilities = declared
    assert all(u.prior.device_values is None for u in host)
    assert all(u.prior.device_values is not None for u in device)
    for a, b in zip(host, device, strict=True):
        assert np.array_equal(a.durations, b.durations) and a.prior.key == b.prior.key
        np.testing.assert_allclose(b.prior.mean, a.prior.mean, rtol=0, atol=1e-6)
        np.testing.assert_allclose(b.prior.sigma, a.prior.sigma, rtol=1e-6, atol=1e-7)
    model = runtime.voice.model
    outs = []
    for utts in (host, device):
        dec = VitsStreamingDecoder(model, "fp32", 4, torch.device("cpu"), torch.float32)
        outs.append(_stream_together(dec, utts, [0, 1], [24, 40]))
    for a, b in zip(*outs, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


def test_priors_of_one_acoustic_call_share_one_device_tensor(tiny_voice_path: Path) -> None:
    """Every prior an acoustic call leaves on the device is a view of that call's one output, so
    the prior memory's flush records the tensor's use on the decoder's stream once per call,
    not once per sentence (each record is a native call that gives the GIL up)."""
    runtime = _runtime(str(tiny_voice_path))
    params = SynthesisParams(speaker=0)  # unseeded: no sentence is encoded again alone (ceil ambiguity)
    sentences = runtime.voice.frontend.sentences("One sentence here. And a second, longer one. A third.")
    jobs = [AcousticJob(s, 0, params, np.random.default_rng(i)) for i, s in enumerate(sentences)]
    declared = runtime.capabilities
    runtime.capabilities = dataclasses.replace(declared, priors_on_device=True)
    try:
        utts = runtime.acoustic_batch(jobs)
    finally:
        runtime.capabilities = declared
    assert len(utts) == 3
    assert len({u.prior.device_values.untyped_storage().data_ptr() for u in utts}) == 1
