"""Our flow-matching estimator against the official `CausalConditionalDecoder` on the same random
weights and inputs: full context and streaming chunks, a padded batch, one and two U-Net levels."""

from __future__ import annotations

import pytest
import torch

from service.models.cosyvoice2.estimator import Estimator, EstimatorConfig
from service.models.cosyvoice2.official import official_estimator


def official(config: EstimatorConfig, seed: int) -> torch.nn.Module:
    """The official class with `config`'s shapes and random weights (LayerNorms near 1 and 0)."""
    model = official_estimator(config)
    rng = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".norm" in name or "block.2." in name:  # LayerNorms: around 1 and 0
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=rng))
            else:
                p.copy_(torch.randn(p.shape, generator=rng) / max(1, p.shape[-1] if p.dim() > 1 else 1) ** 0.5)
    return model.eval()


@pytest.mark.parametrize("channels", [(64,), (32, 48)])
@pytest.mark.parametrize("streaming", [False, True])
def test_velocity_equals_the_official_estimator(channels: tuple[int, ...], streaming: bool) -> None:
    config = EstimatorConfig(channels=channels, attention_head_dim=16, n_blocks=2, num_mid_blocks=2,
                             num_heads=2, static_chunk_size=8)
    theirs = official(config, seed=0)
    ours = Estimator(config).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    g = torch.Generator().manual_seed(1)
    frames = 30
    x, mu, cond = (torch.randn(2, 80, frames, generator=g) for _ in range(3))
    spks = torch.randn(2, 80, generator=g)
    t = torch.tensor([0.3, 0.7])
    mask = torch.ones(2, 1, frames)
    mask[1, :, 21:] = 0  # the second row is shorter
    with torch.no_grad():
        want = theirs(x, mask, mu, t, spks, cond, streaming=streaming)
        got = ours(x, mask, mu, t, spks, cond, streaming=streaming)
    assert float(want.abs().max()) > 0.1
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= 1e-4, err
