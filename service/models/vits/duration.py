"""Stochastic duration predictor (inference direction only): encoder states ->
log-durations per phoneme. Sampling noise enters through `noise`, so the caller's
seeded generator decides reproducibility."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from service.models.vits.text_encoder import ChannelLayerNorm

MIN_BIN_WIDTH = 1e-3
MIN_BIN_HEIGHT = 1e-3
MIN_DERIVATIVE = 1e-3


class DilatedDepthSeparableConv(nn.Module):
    """Residual stack of dilated depthwise convs + 1x1 convs with GELU."""

    def __init__(self, channels: int, kernel_size: int, n_layers: int) -> None:
        super().__init__()
        self.convs_sep = nn.ModuleList()
        self.convs_1x1 = nn.ModuleList()
        self.norms_1 = nn.ModuleList()
        self.norms_2 = nn.ModuleList()
        for i in range(n_layers):
            dilation = kernel_size**i
            padding = (kernel_size * dilation - dilation) // 2
            self.convs_sep.append(
                nn.Conv1d(
                    channels, channels, kernel_size, groups=channels, dilation=dilation,
                    padding=padding,
                )
            )
            self.convs_1x1.append(nn.Conv1d(channels, channels, 1))
            self.norms_1.append(ChannelLayerNorm(channels))
            self.norms_2.append(ChannelLayerNorm(channels))

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None
    ) -> torch.Tensor:
        if g is not None:
            x = x + g
        for sep, n1, pw, n2 in zip(
            self.convs_sep, self.norms_1, self.convs_1x1, self.norms_2, strict=True
        ):
            y = F.gelu(n1(sep(x * mask)))
            y = F.gelu(n2(pw(y)))
            x = x + y
        return x * mask


def inverse_rational_quadratic_spline(
    y: torch.Tensor,
    widths_logits: torch.Tensor,
    heights_logits: torch.Tensor,
    derivs_logits: torch.Tensor,
    tail_bound: float,
) -> torch.Tensor:
    """Inverse of a monotone rational-quadratic spline on [-B, B], identity outside
    (Durkan et al., 2019). Logit tensors have a trailing bin axis."""
    num_bins = widths_logits.shape[-1]
    inside = (y >= -tail_bound) & (y <= tail_bound)
    edge = math.log(math.exp(1 - MIN_DERIVATIVE) - 1)
    derivs_logits = F.pad(derivs_logits, (1, 1), value=edge)

    def knots(logits: torch.Tensor, min_size: float) -> tuple[torch.Tensor, torch.Tensor]:
        sizes = min_size + (1 - min_size * num_bins) * torch.softmax(logits, dim=-1)
        cum = F.pad(torch.cumsum(sizes, dim=-1), (1, 0), value=0.0)
        cum = 2 * tail_bound * cum - tail_bound
        cum = torch.cat([torch.full_like(cum[..., :1], -tail_bound), cum[..., 1:-1],
                         torch.full_like(cum[..., :1], tail_bound)], dim=-1)
        return cum, cum[..., 1:] - cum[..., :-1]

    cumwidths, widths = knots(widths_logits, MIN_BIN_WIDTH)
    cumheights, heights = knots(heights_logits, MIN_BIN_HEIGHT)
    derivs = MIN_DERIVATIVE + F.softplus(derivs_logits)

    search = torch.cat([cumheights[..., :-1], cumheights[..., -1:] + 1e-6], dim=-1)
    y_in = y.clamp(-tail_bound, tail_bound)
    idx = (torch.sum(y_in.unsqueeze(-1) >= search, dim=-1) - 1).clamp(0, num_bins - 1)
    idx = idx.unsqueeze(-1)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.gather(-1, idx).squeeze(-1)

    x_k, w_k = pick(cumwidths), pick(widths)
    y_k, h_k = pick(cumheights), pick(heights)
    delta = pick(heights / widths)
    d_k, d_k1 = pick(derivs[..., :-1]), pick(derivs[..., 1:])

    dy = y_in - y_k
    curv = d_k + d_k1 - 2 * delta
    a = dy * curv + h_k * (delta - d_k)
    b = h_k * d_k - dy * curv
    c = -delta * dy
    disc = b.pow(2) - 4 * a * c
    root = (2 * c) / (-b - torch.sqrt(disc))
    x = root * w_k + x_k
    return torch.where(inside, x, y)


class ConvFlow(nn.Module):
    """Coupling layer whose transform is a rational-quadratic spline."""

    def __init__(
        self, in_channels: int, filter_channels: int, kernel_size: int, n_layers: int,
        num_bins: int, tail_bound: float,
    ) -> None:
        super().__init__()
        self.half_channels = in_channels // 2
        self.filter_channels = filter_channels
        self.num_bins = num_bins
        self.tail_bound = tail_bound
        self.pre = nn.Conv1d(self.half_channels, filter_channels, 1)
        self.convs = DilatedDepthSeparableConv(filter_channels, kernel_size, n_layers)
        self.proj = nn.Conv1d(filter_channels, self.half_channels * (num_bins * 3 - 1), 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        x0, x1 = torch.split(x, [self.half_channels, self.half_channels], dim=1)
        h = self.convs(self.pre(x0), mask, g=g)
        h = self.proj(h) * mask
        b, c, t = x0.shape
        h = h.reshape(b, c, -1, t).permute(0, 1, 3, 2)
        n = self.num_bins
        scale = math.sqrt(self.filter_channels)
        x1 = inverse_rational_quadratic_spline(
            x1, h[..., :n] / scale, h[..., n : 2 * n] / scale, h[..., 2 * n :], self.tail_bound
        )
        return torch.cat([x0, x1], dim=1) * mask


class ElementwiseAffine(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.m = nn.Parameter(torch.zeros(channels, 1))
        self.logs = nn.Parameter(torch.zeros(channels, 1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (x - self.m) * torch.exp(-self.logs) * mask


class StochasticDurationPredictor(nn.Module):
    """Noise -> log-durations through inverted flows conditioned on the encoder.

    The trained network holds `n_flows` spline flows; inference skips the first one
    (it only acts on the unused second channel), as the published model does, so
    `flows` keeps module indices 0 (affine) and 3, 5, 7, ... (splines)."""

    def __init__(
        self, in_channels: int, filter_channels: int, kernel_size: int, n_flows: int,
        num_bins: int, tail_bound: float, gin_channels: int,
    ) -> None:
        super().__init__()
        self.pre = nn.Conv1d(in_channels, filter_channels, 1)
        self.convs = DilatedDepthSeparableConv(filter_channels, kernel_size, 3)
        self.proj = nn.Conv1d(filter_channels, filter_channels, 1)
        self.flows = nn.ModuleDict({"0": ElementwiseAffine(2)})
        for i in range(1, n_flows):
            self.flows[str(2 * i + 1)] = ConvFlow(
                2, filter_channels, kernel_size, 3, num_bins, tail_bound
            )
        self.cond = nn.Conv1d(gin_channels, filter_channels, 1) if gin_channels else None

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, noise: torch.Tensor,
        g: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """noise: [batch, 2, time], already scaled by the noise-w scale."""
        x = self.pre(x)
        if g is not None and self.cond is not None:
            x = x + self.cond(g)
        x = self.convs(x, mask)
        x = self.proj(x) * mask
        z = noise
        spline_keys = sorted((k for k in self.flows if k != "0"), key=int, reverse=True)
        for key in spline_keys:
            z = torch.flip(z, [1])
            flow = self.flows[key]
            assert isinstance(flow, ConvFlow)
            z = flow(z, mask, g=x)
        z = torch.flip(z, [1])
        affine = self.flows["0"]
        assert isinstance(affine, ElementwiseAffine)
        z = affine(z, mask)
        return z[:, :1]
