"""Normalising flow (inference direction): prior sample z_p -> latent z."""

from __future__ import annotations

import torch
from torch import nn


class WaveNet(nn.Module):
    """Non-causal WaveNet body with gated tanh/sigmoid units."""

    def __init__(
        self, hidden: int, kernel_size: int, dilation_rate: int, n_layers: int, gin_channels: int
    ) -> None:
        super().__init__()
        self.hidden = hidden
        self.n_layers = n_layers
        self.in_layers = nn.ModuleList()
        self.res_skip_layers = nn.ModuleList()
        for i in range(n_layers):
            dilation = dilation_rate**i
            padding = (kernel_size * dilation - dilation) // 2
            self.in_layers.append(
                nn.Conv1d(hidden, 2 * hidden, kernel_size, dilation=dilation, padding=padding)
            )
            out = 2 * hidden if i < n_layers - 1 else hidden
            self.res_skip_layers.append(nn.Conv1d(hidden, out, 1))
        self.cond_layer = (
            nn.Conv1d(gin_channels, 2 * hidden * n_layers, 1) if gin_channels else None
        )

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, g: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`mask` None: every frame is valid (skips the multiplies; same result)."""
        output = torch.zeros_like(x)
        cond = self.cond_layer(g) if (g is not None and self.cond_layer is not None) else None
        h = self.hidden
        for i, (inl, rsl) in enumerate(zip(self.in_layers, self.res_skip_layers, strict=True)):
            x_in = inl(x)
            if cond is not None:
                x_in = x_in + cond[:, i * 2 * h : (i + 1) * 2 * h]
            acts = torch.tanh(x_in[:, :h]) * torch.sigmoid(x_in[:, h:])
            res_skip = rsl(acts)
            if i < self.n_layers - 1:
                x = _masked(x + res_skip[:, :h], mask)
                output = output + res_skip[:, h:]
            else:
                output = output + res_skip
        return _masked(output, mask)


def _masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x if mask is None else x * mask


class MeanOnlyCoupling(nn.Module):
    """Affine coupling with a predicted shift only (Piper/VITS `mean_only`)."""

    def __init__(
        self, channels: int, hidden: int, kernel_size: int, dilation_rate: int, n_layers: int,
        gin_channels: int,
    ) -> None:
        super().__init__()
        self.half_channels = channels // 2
        self.pre = nn.Conv1d(self.half_channels, hidden, 1)
        self.enc = WaveNet(hidden, kernel_size, dilation_rate, n_layers, gin_channels)
        self.post = nn.Conv1d(hidden, self.half_channels, 1)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, g: torch.Tensor | None
    ) -> torch.Tensor:
        x0, x1 = torch.split(x, [self.half_channels, self.half_channels], dim=1)
        h = _masked(self.pre(x0), mask)
        h = self.enc(h, mask, g=g)
        m = _masked(self.post(h), mask)
        x1 = _masked(x1 - m, mask)
        return torch.cat([x0, x1], dim=1)


class ResidualCouplingFlow(nn.Module):
    """Couplings interleaved with channel flips; module indices 0, 2, 4, ... hold
    the couplings (odd indices are the parameter-free flips)."""

    def __init__(
        self, channels: int, hidden: int, kernel_size: int, dilation_rate: int, n_layers: int,
        n_flows: int, gin_channels: int,
    ) -> None:
        super().__init__()
        self.flows = nn.ModuleDict(
            {
                str(2 * i): MeanOnlyCoupling(
                    channels, hidden, kernel_size, dilation_rate, n_layers, gin_channels
                )
                for i in range(n_flows)
            }
        )

    @property
    def num_stages(self) -> int:
        """One stage per coupling (with the flip before it), in inference order."""
        return len(self.flows)

    def coupling(self, index: int) -> MeanOnlyCoupling:
        """The coupling that stage `index` runs (inference runs them last to first)."""
        layer = self.flows[sorted(self.flows, key=int, reverse=True)[index]]
        assert isinstance(layer, MeanOnlyCoupling)
        return layer

    def stage(
        self, index: int, z: torch.Tensor, g: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One stage of the inference flow. Running the stages in order is `forward`;
        running them separately lets a streaming decoder keep each stage's output."""
        return self.coupling(index)(torch.flip(z, [1]), mask, g)

    def forward(
        self, z: torch.Tensor, mask: torch.Tensor | None, g: torch.Tensor | None = None
    ) -> torch.Tensor:
        for index in range(self.num_stages):
            z = self.stage(index, z, g, mask)
        return z
