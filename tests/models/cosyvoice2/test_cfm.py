"""Our Euler solver with classifier-free guidance against the official `CausalConditionalCFM` on
the same estimator weights and inputs: the mel after 10 steps, full context and streaming; and a
batch of two utterances equal to each alone, also where one streams and the other does not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from service.models.cosyvoice2.cfm import CfmConfig, fixed_noise, solve
from service.models.cosyvoice2.estimator import Estimator, EstimatorConfig
from service.models.cosyvoice2.official import official

from .test_estimator import official as official_estimator

SMALL = EstimatorConfig(channels=(64,), attention_head_dim=16, n_blocks=1, num_mid_blocks=2, num_heads=2,
                        static_chunk_size=8)


def inputs(frames: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(1, 80, frames, generator=g)
    cond = torch.zeros(1, 80, frames)
    cond[:, :, :7] = torch.randn(1, 80, 7, generator=g)  # a prompt mel over the first frames
    return mu, torch.ones(1, 1, frames), torch.randn(1, 80, generator=g), cond


@pytest.mark.parametrize("streaming", [False, True])
def test_mel_equals_the_official_solver(streaming: bool) -> None:
    config = CfmConfig()
    est = official_estimator(SMALL, seed=2)
    params = SimpleNamespace(solver="euler", sigma_min=1e-6, t_scheduler=config.t_scheduler,
                             training_cfg_rate=0.2, inference_cfg_rate=config.inference_cfg_rate)
    cfm = official("cosyvoice.flow.flow_matching").CausalConditionalCFM
    theirs = cfm(in_channels=240, cfm_params=params, n_spks=1, spk_emb_dim=80, estimator=est)
    ours = Estimator(SMALL).eval()
    ours.load_state_dict(est.state_dict(), strict=True)
    noise = fixed_noise(config)
    assert torch.equal(noise, theirs.rand_noise)
    mu, mask, spks, cond = inputs(26, seed=3)
    with torch.no_grad():
        want, _ = theirs(mu, mask, n_timesteps=config.n_timesteps, spks=spks, cond=cond, streaming=streaming)
        got = solve(ours, noise, mu, mask, spks, cond, config, streaming=streaming)
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= 1e-4, err


def test_a_batch_equals_each_utterance_alone() -> None:
    config = CfmConfig()
    ours = Estimator(SMALL).eval()
    ours.load_state_dict(official_estimator(SMALL, seed=2).state_dict(), strict=True)
    noise = fixed_noise(config)
    a, b = inputs(26, seed=3), inputs(19, seed=4)
    with torch.no_grad():
        alone = [solve(ours, noise, *u, config, streaming=True) for u in (a, b)]
        pad = [torch.nn.functional.pad(x, (0, 26 - 19)) for x in (b[0], b[1], b[3])]
        batch = solve(ours, noise, torch.cat([a[0], pad[0]]), torch.cat([a[1], pad[1]]),
                      torch.cat([a[2], b[2]]), torch.cat([a[3], pad[2]]), config, streaming=True)
    assert float((batch[0] - alone[0][0]).abs().max()) <= 1e-4 * float(alone[0].abs().max())
    assert float((batch[1, :, :19] - alone[1][0]).abs().max()) <= 1e-4 * float(alone[1].abs().max())


def test_a_batch_of_streaming_and_full_context_rows_equals_each_alone() -> None:
    """Each row's mode as a [B] flag (a step's chunks and last chunks in one solve): each row
    equals its solve alone in its own mode, and flags all alike equal the mode given once."""
    config = CfmConfig()
    ours = Estimator(SMALL).eval()
    ours.load_state_dict(official_estimator(SMALL, seed=2).state_dict(), strict=True)
    noise = fixed_noise(config)
    a, b = inputs(26, seed=3), inputs(26, seed=4)
    batch = [torch.cat([x, y]) for x, y in zip(a, b, strict=True)]
    with torch.no_grad():
        alone = [solve(ours, noise, *a, config, streaming=True), solve(ours, noise, *b, config, streaming=False)]
        mixed = solve(ours, noise, *batch, config, streaming=torch.tensor([True, False]))
        for mode in (True, False):
            same = solve(ours, noise, *batch, config, streaming=torch.tensor([mode, mode]))
            assert torch.equal(same, solve(ours, noise, *batch, config, streaming=mode))
        streamed_alike = solve(ours, noise, *b, config, streaming=True)
    for row, want in enumerate(alone):
        assert float((mixed[row] - want[0]).abs().max()) <= 1e-4 * float(want.abs().max())
    assert float((streamed_alike - alone[1]).abs().max()) > 1e-3  # the modes differ: the flag is seen
