"""Conditional flow matching at inference: from noise to mel in a few Euler steps on a cosine
time schedule, with classifier-free guidance (the estimator run with and without its conditions,
the two velocities mixed), as CosyVoice2's `CausalConditionalCFM` does.

The noise is upstream's fixed buffer (seed 0, 80 x 15 000 frames), sliced to the utterance's
length: the same tokens give the same mel, and a streamed utterance, decoded again over a longer
prefix, sees the same noise under the frames it has already produced."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from service.models.compiled import CompiledOrEager
from service.models.cuda_graphs import GraphCapturer, GraphTable, bucket


@dataclass(frozen=True)
class CfmConfig:
    """`flow.decoder.cfm_params` in cosyvoice2.yaml, and the solver's step count."""

    n_timesteps: int = 10
    inference_cfg_rate: float = 0.7
    t_scheduler: str = "cosine"
    temperature: float = 1.0
    noise_frames: int = 50 * 300  # the fixed noise buffer: 300 s of mel at 50 Hz
    noise_seed: int = 0
    mel_bins: int = 80


def fixed_noise(config: CfmConfig) -> torch.Tensor:
    """[1, mel_bins, noise_frames]: upstream's buffer (its global RNG seeded, then one draw)."""
    g = torch.Generator().manual_seed(config.noise_seed)
    return torch.randn([1, config.mel_bins, config.noise_frames], generator=g)


def time_span(config: CfmConfig, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.linspace(0, 1, config.n_timesteps + 1, device=device, dtype=dtype)
    if config.t_scheduler == "cosine":
        t = 1 - torch.cos(t * 0.5 * math.pi)
    return t


def solve(estimator: Callable[..., torch.Tensor], noise: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor,
          spks: torch.Tensor, cond: torch.Tensor, config: CfmConfig,
          streaming: bool | torch.Tensor = False) -> torch.Tensor:
    """Mel [B, 80, T] for B utterances at once. noise: the fixed buffer; mu, cond [B, 80, T];
    mask [B, 1, T]; spks [B, 80]; `streaming`: every row's mode or each row's ([B] bool). Each
    step runs the estimator once over 2B rows: the B conditioned, then the same B with mu,
    speaker and prompt zeroed (the unconditioned half)."""
    b, _, frames = mu.shape
    x = noise[:, :, :frames].to(mu.device, mu.dtype).expand(b, -1, -1) * config.temperature
    span = time_span(config, mu.dtype, mu.device)
    t, dt = span[0], span[1] - span[0]
    rate = config.inference_cfg_rate
    mask2 = torch.cat([mask, mask])
    mu2 = torch.cat([mu, torch.zeros_like(mu)])
    spks2 = torch.cat([spks, torch.zeros_like(spks)])
    cond2 = torch.cat([cond, torch.zeros_like(cond)])
    modes = torch.cat([streaming, streaming]) if isinstance(streaming, torch.Tensor) else streaming
    for step in range(1, len(span)):
        v = estimator(torch.cat([x, x]), mask2, mu2, t.expand(2 * b), spks2, cond2, streaming=modes)
        guided, free = v[:b], v[b:]
        x = x + dt * ((1.0 + rate) * guided - rate * free)
        t = t + dt
        if step < len(span) - 1:
            dt = span[step + 1] - t
    return x.float()


# A captured solve: the graph, its static inputs (mu, mask, spks, cond, streaming rows) and its output.
SolveGraph = tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], torch.Tensor]


class GraphedSolve:
    """`solve` replayed as CUDA graphs, one per (rows, frames) bucket (powers of two): eagerly
    its estimator passes are thousands of small kernel launches, whatever the batch. Each row's
    mode (streaming chunks or full context) is an input, so a step's chunks and last chunks
    share one launch. Inputs are padded up to the bucket: padded frames are masked, as in a
    batch of unequal rows, and the noise under the real frames is the same prefix of the fixed
    buffer."""

    SMALLEST_FRAMES = 128

    def __init__(self, estimator: nn.Module, noise: torch.Tensor, config: CfmConfig,
                 capturer: GraphCapturer | None = None, compiled: bool = False) -> None:
        self.estimator, self.noise, self.config = estimator, noise, config
        self.capturer = capturer or GraphCapturer(noise.device)
        # `compiled`: the estimator's passes as inductor's fused kernels under the graphs (compiled
        # at the first capture's warm-up, for every bucket: dynamic shapes; eager if that fails).
        self.compiled = compiled
        self._estimator = CompiledOrEager(estimator, "the flow's estimator", compiled)
        self._graphs: GraphTable[tuple[int, int], SolveGraph] = GraphTable(
            self.capturer, "the flow's solve", self._make)

    def buckets(self, rows: int, frames: int) -> tuple[int, int]:
        return bucket(rows), bucket(frames, self.SMALLEST_FRAMES)

    def capture(self, rows: int, frames: int) -> None:
        self._graphs.prepare(self.buckets(rows, frames))

    def _make(self, key: tuple[int, int]) -> SolveGraph:
        b, t = key
        dev, bins = self.noise.device, self.config.mel_bins
        static = (torch.zeros(b, bins, t, device=dev), torch.ones(b, 1, t, device=dev),
                  torch.zeros(b, bins, device=dev), torch.zeros(b, bins, t, device=dev),
                  torch.ones(b, dtype=torch.bool, device=dev))

        def run(mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                streaming: torch.Tensor) -> torch.Tensor:
            return solve(self._estimator, self.noise, mu, mask, spks, cond, self.config, streaming=streaming)

        graph, out = self._estimator.retry_eager(lambda: self.capturer.capture(run, *static, warmups=1))
        return graph, static, out

    def __call__(self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                 streaming: bool | torch.Tensor) -> torch.Tensor:
        """`solve(...)` for FP32 inputs as `solve` takes them."""
        b, _, t = mu.shape
        key = self.buckets(b, t)
        found = self._graphs.get(key, key)
        assert found is not None, "a solve that cannot be captured raises"
        graph, (s_mu, s_mask, s_spks, s_cond, s_streaming), out = found
        s_mu.zero_()
        s_cond.zero_()
        s_spks.zero_()
        s_mask.zero_()
        s_mask[b:] = 1.0  # rows past the batch: all frames valid, zero inputs (finite, unread)
        s_mu[:b, :, :t] = mu
        s_mask[:b, :, :t] = mask
        s_spks[:b] = spks
        s_cond[:b, :, :t] = cond
        if isinstance(streaming, torch.Tensor):
            s_streaming[:b] = streaming
        else:
            s_streaming.fill_(streaming)
        graph.replay()
        # A copy: the next replay writes the graph's output again, and callers keep slices of
        # this one (a sentence's mel tail waits for its next chunk).
        return out[:b, :, :t].clone()
