"""Normalising flow (inference direction): prior sample z_p -> latent z."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


class FoldedCoupling(nn.Module):
    """The same coupling with its 1x1 `pre` conv folded into the first WaveNet conv
    and its 1x1 `post` conv folded into the skip outputs: 14% less flow time on
    ONNX Runtime CPU. Inference only; built from a trained MeanOnlyCoupling.

    Folding `pre` makes the first conv read the 96-channel half instead of the
    192-channel hidden state. `pre`'s bias then enters only where the original
    conv saw real (unmasked, in-range) frames, so it rides on a one-channel
    conv over the mask rather than on the bias: edges and padding stay exact."""

    def __init__(self, coupling: MeanOnlyCoupling) -> None:
        super().__init__()
        enc = coupling.enc
        self.half_channels = coupling.half_channels
        self.hidden = enc.hidden
        self.n_layers = enc.n_layers
        self.pre = coupling.pre
        self.cond_layer = enc.cond_layer
        self.in_layers = nn.ModuleList(enc.in_layers[1:])
        first = enc.in_layers[0]
        assert isinstance(first, nn.Conv1d) and first.bias is not None and coupling.pre.bias is not None
        assert coupling.post.bias is not None
        self.first_padding, self.first_dilation = int(first.padding[0]), int(first.dilation[0])
        w_pre, b_pre = coupling.pre.weight.detach()[:, :, 0], coupling.pre.bias.detach()
        w_first = first.weight.detach()
        self.first_weight = nn.Parameter(torch.einsum("ohk,hc->ock", w_first, w_pre), requires_grad=False)
        self.first_mask_weight = nn.Parameter(
            torch.einsum("ohk,h->ok", w_first, b_pre).unsqueeze(1), requires_grad=False
        )
        self.first_bias = nn.Parameter(first.bias.detach().clone(), requires_grad=False)
        w_post, b_post = coupling.post.weight.detach()[:, :, 0], coupling.post.bias.detach()
        h = enc.hidden
        self.res_skip = nn.ModuleList()
        for i, layer in enumerate(enc.res_skip_layers):
            assert isinstance(layer, nn.Conv1d) and layer.bias is not None
            w, b = layer.weight.detach()[:, :, 0], layer.bias.detach()
            last = i == enc.n_layers - 1
            w_res, b_res = (w[:0], b[:0]) if last else (w[:h], b[:h])
            w_skip, b_skip = (w, b) if last else (w[h:], b[h:])
            b_post = b_post + w_post @ b_skip
            conv = nn.Conv1d(h, w_res.shape[0] + self.half_channels, 1).requires_grad_(False)
            conv.weight.copy_(torch.cat([w_res, w_post @ w_skip]).unsqueeze(-1))
            assert conv.bias is not None
            conv.bias.copy_(torch.cat([b_res, torch.zeros(self.half_channels)]))
            self.res_skip.append(conv)
        self.post_bias = nn.Parameter(b_post.view(1, -1, 1), requires_grad=False)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, g: torch.Tensor | None
    ) -> torch.Tensor:
        x0, x1 = torch.split(x, [self.half_channels, self.half_channels], dim=1)
        valid = torch.ones_like(x0[:, :1]) if mask is None else mask
        x0_in = _masked(x0, mask)
        h = _masked(self.pre(x0_in), mask)
        cond = self.cond_layer(g) if (g is not None and self.cond_layer is not None) else None
        hid = self.hidden
        m = None
        for i in range(self.n_layers):
            if i == 0:
                x_in = F.conv1d(x0_in, self.first_weight, None, padding=self.first_padding,
                                dilation=self.first_dilation)
                x_in = x_in + F.conv1d(valid, self.first_mask_weight, self.first_bias,
                                       padding=self.first_padding, dilation=self.first_dilation)
            else:
                x_in = self.in_layers[i - 1](h)
            if cond is not None:
                x_in = x_in + cond[:, i * 2 * hid : (i + 1) * 2 * hid]
            acts = torch.tanh(x_in[:, :hid]) * torch.sigmoid(x_in[:, hid:])
            res_skip = self.res_skip[i](acts)
            if i < self.n_layers - 1:
                h = _masked(h + res_skip[:, :hid], mask)
                skip = res_skip[:, hid:]
            else:
                skip = res_skip
            m = skip if m is None else m + skip
        assert m is not None
        m = _masked(m + self.post_bias, mask)
        x1 = _masked(x1 - m, mask)
        return torch.cat([x0, x1], dim=1)


def fold_couplings(flow: ResidualCouplingFlow) -> None:
    """Replace every coupling of `flow` by its FoldedCoupling (in place)."""
    for key, layer in flow.flows.items():
        if isinstance(layer, MeanOnlyCoupling):
            flow.flows[key] = FoldedCoupling(layer)


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

    def coupling(self, index: int) -> MeanOnlyCoupling | FoldedCoupling:
        """The coupling that stage `index` runs (inference runs them last to first)."""
        layer = self.flows[sorted(self.flows, key=int, reverse=True)[index]]
        assert isinstance(layer, MeanOnlyCoupling | FoldedCoupling)
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
