"""Our HiFT against the official `HiFTGenerator` (token2wav-cosyvoice, the upstream tree) on the
same random weights, mel and seed."""

from __future__ import annotations

import logging

import pytest
import torch

from service.models.cosyvoice2.hift import GraphedHiFT, HiftConfig, load_hift
from service.models.cosyvoice2.official import official_hift as official_hift_class
from service.models.cuda_graphs import GraphCapturer

# CosyVoice2-0.5B's vocoder with fewer channels, so the test runs in seconds on a CPU.
SMALL = HiftConfig(base_channels=64, f0_cond_channels=32)


def official_hift(config: HiftConfig, seed: int) -> torch.nn.Module:
    """The official class with `config`'s shapes and every parameter random (Snake alphas and
    weight-norm gains too, so a misplaced one shows)."""
    model = official_hift_class(config)
    rng = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("alpha"):
                p.copy_(0.5 + torch.rand(p.shape, generator=rng))
            elif name.endswith("original0"):  # weight-norm gain
                p.copy_(0.5 + 0.5 * torch.rand(p.shape, generator=rng))
            else:
                p.copy_(torch.randn(p.shape, generator=rng) * 0.1)
    return model.eval()


def test_waveform_equals_the_official_vocoder() -> None:
    theirs = official_hift(SMALL, seed=0)
    ours = load_hift(SMALL, theirs.state_dict())
    mel = torch.randn(2, SMALL.in_channels, 37, generator=torch.Generator().manual_seed(1))
    # F0 from random weights stays near 0 Hz: scale the head so it spans speech pitches and
    # unvoiced frames (|F0| under the threshold), exercising the sine source's phase and harmonics.
    with torch.no_grad():
        spread = float(ours.f0_predictor(mel).std())
        for model in (theirs, ours):
            model.f0_predictor.classifier.weight.mul_(100.0 / spread)
            model.f0_predictor.classifier.bias.fill_(120.0)
    torch.manual_seed(7)
    want, _ = theirs.inference(mel)
    with torch.no_grad():
        got, _ = ours(mel, torch.Generator().manual_seed(7))
        f0 = ours.f0_predictor(mel)
    assert (f0 > SMALL.nsf_voiced_threshold).any() and (f0 <= SMALL.nsf_voiced_threshold).any()
    assert got.shape == want.shape == (2, 37 * SMALL.samples_per_frame)
    peak = float(want.abs().max())
    assert peak > 0.01
    err = float((got - want).abs().max())
    assert err <= 1e-4 * max(1.0, peak), err


def test_rows_with_their_own_generators_each_draw_as_alone() -> None:
    """The slot decoder's batched vocoder call: a generator per row gives each row the audio
    it gets alone from that generator (the sine source's draws are per row)."""
    hift = load_hift(SMALL, official_hift(SMALL, seed=0).state_dict())
    mel = torch.randn(3, SMALL.in_channels, 21, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hift.f0_predictor.classifier.weight.mul_(100.0)
        hift.f0_predictor.classifier.bias.fill_(150.0)
        together, _ = hift(mel, [torch.Generator().manual_seed(s) for s in (3, 4, 5)])
        alone = [hift(mel[i : i + 1], torch.Generator().manual_seed(s))[0] for i, s in enumerate((3, 4, 5))]
    for i, a in enumerate(alone):
        assert torch.allclose(together[i : i + 1], a, atol=1e-5)
    assert not torch.allclose(alone[0], hift(mel[:1], torch.Generator().manual_seed(4))[0], atol=1e-3)


def test_a_vocoder_call_that_cannot_be_captured_runs_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    """`GraphedHiFT` where capturing fails (here: no CUDA): a warning, then every call of that
    shape runs the vocoder eagerly, drawing from the rows' own generators as the vocoder does."""
    hift = load_hift(SMALL, official_hift(SMALL, seed=0).state_dict())
    graphed = GraphedHiFT(hift, GraphCapturer(torch.device("cpu")))
    with caplog.at_level(logging.WARNING):
        graphed.capture(2, 12, 960)
    assert "cannot be captured" in caplog.text
    assert not graphed.graphed(2, 12, torch.zeros(2, 1, 960))
    mel, cache = torch.randn(2, 80, 12), torch.randn(2, 1, 960)
    caplog.clear()
    with torch.inference_mode(), caplog.at_level(logging.INFO):
        got = graphed(mel, [torch.Generator().manual_seed(s) for s in (1, 2)], cache)
        graphed(mel, [torch.Generator().manual_seed(s) for s in (1, 2)], cache)
        want = hift(mel, [torch.Generator().manual_seed(s) for s in (1, 2)], cache)
    # The server's log says once per shape that it ran eagerly (where launches still cost).
    assert caplog.text.count("the vocoder calls of shape (2, 12, 960) have no CUDA graph") == 1
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
