"""Style-conditioned building blocks shared by Kokoro's prosody predictor and decoder."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

# The official residual blocks scale by rsqrt(2) computed in float32; the same float keeps them equal.
INV_SQRT2 = float(torch.rsqrt(torch.tensor(2.0)))


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Snake activation x + sin^2(alpha x) / alpha (periodic inductive bias for audio), in as
    few passes over `x` as eager torch allows: the decoder's audio-rate layers are bound by them."""
    s = torch.sin(alpha * x)
    return torch.addcmul(x, s.mul_(s), alpha.reciprocal())


def frame_mask(lengths: torch.Tensor | None, size: int) -> torch.Tensor | None:
    """[B, 1, size] float mask, 1 on each row's first `lengths[b]` positions (None: no padding)."""
    if lengths is None:
        return None
    return (torch.arange(size, device=lengths.device) < lengths.view(-1, 1)).unsqueeze(1).float()


def masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`x` with each row's padding zeroed, so the next convolution sees there what it sees past
    the end of an unpadded row."""
    return x if mask is None else x * mask.to(x.dtype)


def adaptive_instance_norm(x: torch.Tensor, mask: torch.Tensor | None, scale: torch.Tensor,
                           shift: torch.Tensor, eps: float) -> torch.Tensor:
    """`scale * instance_norm(x) + shift` over time of [B, C, T] (scale and shift [B, C, 1]),
    over each row's valid positions only, as a subtraction and one multiply-add over `x`.

    The statistics are taken in FP32 whatever `x` is: a variance summed over thousands of
    positions leaves FP16's range, and a batch of padded rows must normalise each row as if it
    were alone. The mean is subtracted before the gain: folding it into the shift cancels (the
    sine source's phase carries such an error into every later sample)."""
    xf = x.float()
    if mask is None:
        var, mean = torch.var_mean(xf, dim=-1, correction=0, keepdim=True)
        centred = xf - mean
    else:
        count = mask.sum(-1, keepdim=True)
        mean = (xf * mask).sum(-1, keepdim=True) / count
        centred = (xf - mean) * mask
        var = centred.square().sum(-1, keepdim=True) / count
    y = torch.addcmul(shift.float(), centred, torch.rsqrt(var + eps) * scale.float())
    return masked(y.to(x.dtype), mask)


class AdaIN1d(nn.Module):
    """Instance norm over time, then a style-predicted scale (1 + gamma) and shift.

    The statistics span the whole sequence given (its valid positions, with a mask), so a
    decoder run on a window of frames differs from the whole-utterance run."""

    def __init__(self, style_dim: int, channels: int) -> None:
        super().__init__()
        # affine=True only to carry the official (identity-initialised) norm weights.
        self.norm = nn.InstanceNorm1d(channels, affine=True)
        self.fc = nn.Linear(style_dim, 2 * channels)

    def forward(self, x: torch.Tensor, style: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        gamma, beta = self.fc(style).unsqueeze(-1).chunk(2, dim=1)
        # (1 + gamma) * (norm(x) * w + b) + beta, with the norm's own affine folded in.
        weight, bias = self.norm.weight.view(1, -1, 1), self.norm.bias.view(1, -1, 1)
        return adaptive_instance_norm(x, mask, (1 + gamma) * weight, (1 + gamma) * bias + beta, self.norm.eps)


class AdaLayerNorm(nn.Module):
    """Layer norm over channels (no affine) with a style-predicted scale and shift; x is [B, N, C]."""

    def __init__(self, style_dim: int, channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.channels = channels
        self.eps = eps
        self.fc = nn.Linear(style_dim, 2 * channels)

    def forward(self, x: torch.Tensor, style: torch.Tensor) -> torch.Tensor:
        gamma, beta = self.fc(style).unsqueeze(1).chunk(2, dim=-1)
        return (1 + gamma) * F.layer_norm(x, (self.channels,), eps=self.eps) + beta


class ChannelLayerNorm(nn.Module):
    """Layer norm over the channels of a [B, C, T] tensor (official names gamma/beta)."""

    def __init__(self, channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.transpose(1, -1), (x.shape[1],), self.gamma, self.beta, self.eps)
        return y.transpose(1, -1)


class AdainResBlk1d(nn.Module):
    """StyleTTS2's residual block: two AdaIN + LeakyReLU + conv stages, a 1x1 shortcut where
    the width changes, and optionally a 2x upsampling of time (a depthwise transposed conv on
    the residual path, nearest repetition on the shortcut)."""

    def __init__(self, dim_in: int, dim_out: int, style_dim: int, upsample: bool = False) -> None:
        super().__init__()
        self.upsample = upsample
        self.norm1 = AdaIN1d(style_dim, dim_in)
        self.conv1 = nn.Conv1d(dim_in, dim_out, 3, padding=1)
        self.norm2 = AdaIN1d(style_dim, dim_out)
        self.conv2 = nn.Conv1d(dim_out, dim_out, 3, padding=1)
        self.conv1x1 = nn.Conv1d(dim_in, dim_out, 1, bias=False) if dim_in != dim_out else None
        self.pool = (nn.ConvTranspose1d(dim_in, dim_in, 3, stride=2, padding=1, output_padding=1, groups=dim_in)
                     if upsample else None)

    def forward(self, x: torch.Tensor, style: torch.Tensor, mask: torch.Tensor | None = None,
                mask_out: torch.Tensor | None = None) -> torch.Tensor:
        """`mask`: [B, 1, T] valid positions of padded rows (None: no padding); `mask_out`: the
        same at the output's rate (an upsampling block doubles it)."""
        mask_out = mask if mask_out is None else mask_out
        h = F.leaky_relu(self.norm1(x, style, mask), 0.2)
        if self.pool is not None:
            h = masked(self.pool(h), mask_out)
        h = self.conv2(F.leaky_relu(self.norm2(self.conv1(h), style, mask_out), 0.2))
        shortcut = x.repeat_interleave(2, dim=-1) if self.upsample else x
        if self.conv1x1 is not None:
            shortcut = self.conv1x1(shortcut)
        return masked((h + shortcut) * INV_SQRT2, mask_out)
