"""The slot decoder: batched fixed-shape steps with per-session state equal a full decode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from service.models.family import StepRows
from service.models.vits.model import VitsModel
from service.models.vits.streaming import VitsStreamingDecoder
from service.synthesis import SynthesisParams, Utterance, open_synthesizer, prior_rows


def _utterances(voice: str | None, text: str, speaker: int | None) -> tuple[VitsModel, list[Utterance]]:
    syn = open_synthesizer(voice, backend="torch")
    return syn.voice.model, syn.prepare(text, SynthesisParams(seed=7, speaker=speaker))


@torch.inference_mode()
def _full(model: VitsModel, u: Utterance, device: torch.device) -> np.ndarray:
    sid = None if u.sid is None else torch.tensor([u.sid], device=device)
    z_p = torch.from_numpy(u.z_p)[None].to(device)
    z = model.flow_reverse(z_p, torch.ones(1, 1, z_p.shape[2], device=device), sid)
    return model.vocode(z, sid)[0].float().cpu().numpy()


def _stream_together(dec: VitsStreamingDecoder, utts: list[Utterance], slots: list[int],
                     sizes: list[int]) -> list[np.ndarray]:
    """Decode `utts` side by side, one batched step per size in `sizes` (then `sizes[-1]`
    until every utterance is out), each in its own slot."""
    dec.reset(slots)
    fed, pieces = 0, [[] for _ in utts]  # type: list[list[np.ndarray]]
    k = 0
    while any(fed - dec.lag < u.frames for u in utts):
        n = sizes[min(k, len(sizes) - 1)]
        inputs = prior_rows([u.prior for u in utts], [fed] * len(utts), n)
        sids = None if utts[0].sid is None else [u.sid or 0 for u in utts]
        audio = dec.step(StepRows(slots, inputs, [fed] * len(utts), [u.frames for u in utts], sids))
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
    dec = VitsStreamingDecoder(model, "fp32", 6, torch.device("cpu"), torch.float32)
    _stream_together(dec, utts[::-1], [5, 0, 3], [40])  # leaves state behind in the slots
    out = _stream_together(dec, utts, [0, 3, 5], [13 + dec.lag, 13, 29])
    for u, audio in zip(utts, out, strict=True):
        full = _full(model, u, torch.device("cpu"))
        assert audio.shape == full.shape
        np.testing.assert_allclose(audio, full, atol=1e-4, rtol=0)


def test_a_slot_step_does_not_touch_other_slots(tiny_voice_path: Path) -> None:
    model, utts = _utterances(str(tiny_voice_path), "One sentence to decode.", 0)
    dec = VitsStreamingDecoder(model, "fp32", 4, torch.device("cpu"), torch.float32)
    dec.reset(range(4))
    for h in dec.history:
        h[2].fill_(0.5)
    _stream_together(dec, utts, [1], [20])
    for h in dec.history:
        assert torch.all(h[2] == 0.5) and torch.all(h[0] == 0) and torch.all(h[3] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_cuda_graph_steps_equal_eager_steps_and_the_full_decode(precision: str) -> None:
    """On CUDA, steps replayed from captured graphs (padded to a bucket) give what eager steps
    give, and FP32 equals the full decode; FP16 (with its FP32 pins) stays close to it."""
    from service.backends.torch_backend import TorchBackend
    from service.voices import Voice, find_voice

    voice = Voice(find_voice(None))
    backend = TorchBackend(voice, device="cuda")
    utts = open_synthesizer(None, backend="torch").prepare(
        "Hello there, this is a streaming test. Short one. And a third sentence here.", SynthesisParams(seed=7))
    lag = backend.streaming_lag()
    graphed = backend.streaming_decoder(precision, 8, max_rows=4, graph_frames=(20 + lag, 20))
    eager = backend.streaming_decoder(precision, 8, max_rows=4, graphs=False)
    a = _stream_together(graphed, utts, [0, 1, 2], [20 + lag, 20])
    b = _stream_together(eager, utts, [0, 1, 2], [20 + lag, 20])
    model = backend.models["fp32"]
    for u, x, y in zip(utts, a, b, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-3 if precision == "fp16" else 1e-5, rtol=0)
        full = _full(model, u, torch.device("cuda"))
        err = np.abs(x - full).max()
        assert err <= (2e-2 if precision == "fp16" else 1e-4), err
