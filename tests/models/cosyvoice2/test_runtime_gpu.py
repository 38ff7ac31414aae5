"""The CosyVoice2 runtime's CUDA graphs against eager calls: token steps (`GraphedTokenStep`:
the same scores and cache, for batches that pad to a bucket and spans that cross one) and flow
solves (`GraphedSolve`: the same mel for a padded batch of unequal rows)."""

from __future__ import annotations

import copy

import pytest
import torch

from service.models.cosyvoice2.cfm import CfmConfig, GraphedSolve, fixed_noise, solve
from service.models.cosyvoice2.estimator import Estimator, EstimatorConfig
from service.models.cosyvoice2.lm import KVCache, Qwen2Config, SpeechLM
from service.models.cosyvoice2.runtime import GraphedTokenStep

CONFIG = Qwen2Config(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                     vocab_size=320, speech_token_size=200)


@pytest.mark.gpu
@torch.inference_mode()
def test_graphed_steps_equal_eager_steps() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    lm = SpeechLM(CONFIG).to(dev).eval()
    cache = KVCache.empty(CONFIG, rows=6, capacity=300, device=dev)
    prompts = {1: 50, 3: 12, 4: 61}  # rows and their prompt lengths: the steps cross span 64
    for row, n in prompts.items():
        lm(torch.randn(1, n, CONFIG.hidden_size, device=dev), cache, torch.tensor([row], device=dev))
    eager = copy.deepcopy(cache)
    graphed = GraphedTokenStep(lm, cache, scratch=0)
    lengths = dict(prompts)
    for step in range(8):
        rows = [3, 1, 4] if step % 2 else [4, 1]  # 3 rows pad to 4 (the scratch row)
        x = torch.randn(len(rows), 1, CONFIG.hidden_size, device=dev)
        for r in rows:
            lengths[r] += 1
        span = max(lengths[r] for r in rows)
        at = torch.tensor(rows, device=dev)
        want = lm(x, eager, at, span=span)
        got = graphed(x, at, span)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert graphed.buckets(3, 66) in graphed._graphs and graphed.buckets(2, 60) in graphed._graphs
    real = list(prompts)
    torch.testing.assert_close(cache.lengths[real], eager.lengths[real], atol=0, rtol=0)
    for mine, theirs in zip(cache.keys + cache.values, eager.keys + eager.values, strict=True):
        torch.testing.assert_close(mine[real], theirs[real], atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@torch.inference_mode()
def test_graphed_solves_equal_eager_solves() -> None:
    """A batch of unequal rows padded to its bucket (3 rows of up to 150 frames: 4 x 256) solves
    as the eager batch does, streaming and not (TF32 convolutions off: their rounding depends on
    the shape)."""
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        solves_equal()
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def solves_equal() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    config = EstimatorConfig(channels=(64,), attention_head_dim=16, n_blocks=1, num_mid_blocks=1, num_heads=2)
    estimator = Estimator(config).to(dev).eval()
    cfm = CfmConfig()
    noise = fixed_noise(cfm).to(dev)
    graphed = GraphedSolve(estimator, noise, cfm)
    frames = torch.tensor([150, 90, 120], device=dev)
    mask = (torch.arange(150, device=dev)[None, :] < frames[:, None]).float()[:, None]
    mu = torch.randn(3, 80, 150, device=dev) * mask
    cond = torch.zeros(3, 80, 150, device=dev)
    cond[:, :, :40] = torch.randn(3, 80, 40, device=dev)
    spks = torch.randn(3, 80, device=dev)
    for streaming in (True, False):
        want = solve(estimator, noise, mu, mask, spks, cond, cfm, streaming=streaming)
        got = graphed(mu, mask, spks, cond, streaming)
        assert got.shape == want.shape == (3, 80, 150)
        for i, n in enumerate(frames.tolist()):
            torch.testing.assert_close(got[i, :, :n], want[i, :, :n], atol=1e-4, rtol=1e-4)
    assert set(graphed._graphs) == {(4, 256, True), (4, 256, False)}
