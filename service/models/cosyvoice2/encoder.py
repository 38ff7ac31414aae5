"""CosyVoice2's token encoder: speech-token embeddings through a pre-lookahead convolution (each
token sees the next three), conformer blocks with relative-position self-attention (chunk-causal
when streaming), a 2x nearest upsample to the mel rate, and more conformer blocks.

Module names follow the official `UpsampleConformerEncoder` as CosyVoice2 configures it (linear
input layer, ESPnet relative positions, no convolution module, no macaron feed-forward), so
`flow.pt`'s `encoder.*` entries load as they are."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from service.models.cosyvoice2.estimator import attention_mask
from service.models.transfer import pinned, to_device


@dataclass(frozen=True)
class EncoderConfig:
    """`flow.encoder` in cosyvoice2.yaml (CosyVoice2-0.5B's values as defaults)."""

    size: int = 512  # input_size = output_size; upstream's lookahead and upsample layers assume 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    static_chunk_size: int = 25  # tokens
    pre_lookahead_len: int = 3
    up_stride: int = 2  # token_mel_ratio


def relative_positions(size: int, length: int, device: torch.device | None = None) -> torch.Tensor:
    """ESPnet's relative sinusoidal encoding for `length` queries: [1, 2 * length - 1, size],
    positions length-1 ... -(length-1)."""
    position = torch.arange(0, length, dtype=torch.float32, device=device).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, size, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / size))
    positive = torch.zeros(length, size, device=device)
    negative = torch.zeros(length, size, device=device)
    positive[:, 0::2] = torch.sin(position * div_term)
    positive[:, 1::2] = torch.cos(position * div_term)
    negative[:, 0::2] = torch.sin(-1 * position * div_term)
    negative[:, 1::2] = torch.cos(-1 * position * div_term)
    return torch.cat([torch.flip(positive, [0]).unsqueeze(0), negative[1:].unsqueeze(0)], dim=1)


@functools.lru_cache(maxsize=256)
def _host_positions(size: int, length: int, device_type: str) -> torch.Tensor:
    with torch.inference_mode(False):
        return pinned(relative_positions(size, length), torch.device(device_type))


def positions(size: int, like: torch.Tensor, on_device: bool = False) -> torch.Tensor:
    """`relative_positions` for `like`'s length, on its device and in its dtype: made once per
    length, kept in host memory a copy to the device reads without waiting; `on_device`: made
    there (no host memory for a CUDA graph to hold on to)."""
    if on_device:
        return relative_positions(size, like.shape[1], like.device).to(like.dtype)
    return to_device(_host_positions(size, like.shape[1], like.device.type), like.device).to(like.dtype)


class InputLayer(nn.Module):
    """Linear, LayerNorm, then the sqrt(size) scale of the positional-encoding layer."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(size, size), nn.LayerNorm(size, eps=1e-5))
        self.scale = math.sqrt(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.scale


class RelPositionAttention(nn.Module):
    def __init__(self, heads: int, size: int) -> None:
        super().__init__()
        self.h, self.d_k = heads, size // heads
        self.linear_q = nn.Linear(size, size)
        self.linear_k = nn.Linear(size, size)
        self.linear_v = nn.Linear(size, size)
        self.linear_out = nn.Linear(size, size)
        self.linear_pos = nn.Linear(size, size, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.d_k))

    @staticmethod
    def rel_shift(x: torch.Tensor) -> torch.Tensor:
        """[B, H, T, 2T-1] scores by relative offset -> [B, H, T, T] by key position."""
        b, h, t, n = x.shape
        padded = torch.cat([x.new_zeros(b, h, t, 1), x], dim=-1).view(b, h, n + 1, t)
        return padded[:, :, 1:].reshape(b, h, t, n)[:, :, :, : n // 2 + 1]

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, T, D]; mask [B, T, T] boolean (True: may attend); pos [1, 2T-1, D]."""
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.h, self.d_k)
        k = self.linear_k(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos).view(pos.shape[0], -1, self.h, self.d_k).transpose(1, 2)
        ac = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        bd = self.rel_shift(torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1)))
        scores = (ac + bd) / math.sqrt(self.d_k)
        # As upstream: masked scores -inf, softmax, masked weights 0 (a row with no key: all 0).
        blocked = ~mask[:, None]
        attn = torch.softmax(scores.masked_fill(blocked, -float("inf")), dim=-1).masked_fill(blocked, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, self.h * self.d_k)
        return self.linear_out(out)


class FeedForward(nn.Module):
    def __init__(self, size: int, units: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(size, units)
        self.w_2 = nn.Linear(units, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm relative-position self-attention and a Swish feed-forward, each residual."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.norm_mha = nn.LayerNorm(config.size, eps=1e-12)
        self.self_attn = RelPositionAttention(config.attention_heads, config.size)
        self.norm_ff = nn.LayerNorm(config.size, eps=1e-12)
        self.feed_forward = FeedForward(config.size, config.linear_units)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), mask, pos)
        return x + self.feed_forward(self.norm_ff(x))


class PreLookahead(nn.Module):
    """Each position mixed with the next `pre_lookahead_len` (zeros, or the given context, past
    the end), then a causal conv; residual."""

    def __init__(self, size: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(size, size, lookahead + 1)
        self.conv2 = nn.Conv1d(size, size, 3)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None, lengths: torch.Tensor | None = None
                ) -> torch.Tensor:
        """x [B, T, D]; `context` [B, C, D] (C <= lookahead) follows each row's last valid
        position (`lengths` [B]; None: all T), zeros after it, as each row alone would see.
        Nothing is read back from the device, so a CUDA graph can hold the call."""
        _, t, d = x.shape
        if lengths is None:
            h = x.transpose(1, 2)
            if context is not None and context.shape[1]:
                h = torch.cat([h, context.transpose(1, 2)], dim=2)
            h = F.pad(h, (0, t + self.lookahead - h.shape[2]))
        else:
            valid = torch.arange(t, device=x.device)[None, :] < lengths[:, None]
            padded = F.pad(torch.where(valid[..., None], x, 0.0), (0, 0, 0, self.lookahead))
            if context is not None and context.shape[1]:
                at = lengths[:, None] + torch.arange(context.shape[1], device=x.device)[None, :]
                padded = padded.scatter(1, at[..., None].expand(-1, -1, d), context)
            h = padded.transpose(1, 2)
        h = F.leaky_relu(self.conv1(h))
        h = self.conv2(F.pad(h, (2, 0)))
        return h.transpose(1, 2) + x


class Upsample(nn.Module):
    """Nearest 2x, then a causal conv of 2 * stride + 1 taps."""

    def __init__(self, size: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(size, size, stride * 2 + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.interpolate(x, scale_factor=float(self.stride), mode="nearest")
        return self.conv(F.pad(h, (self.stride * 2, 0)))


class TokenEncoder(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = InputLayer(config.size)
        self.pre_lookahead_layer = PreLookahead(config.size, config.pre_lookahead_len)
        self.encoders = nn.ModuleList(ConformerLayer(config) for _ in range(config.num_blocks))
        self.up_layer = Upsample(config.size, config.up_stride)
        self.up_embed = InputLayer(config.size)
        self.up_encoders = nn.ModuleList(ConformerLayer(config) for _ in range(config.num_up_blocks))
        self.after_norm = nn.LayerNorm(config.size, eps=1e-5)

    def forward(self, x: torch.Tensor, sizes: Sequence[int] | torch.Tensor, context: torch.Tensor | None = None,
                streaming: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Token embeddings x [B, T, D] (each row's length in `sizes`: on the host, nothing here
        waits for the device; on the device, nothing is read back or copied from the host, so a
        CUDA graph can hold the call) -> [B, 2T, D] and their lengths [B]. `context`: embeddings of the next
        `pre_lookahead_len` tokens (streaming, not the last chunk)."""
        cfg = self.config
        t = x.shape[1]
        on_device = isinstance(sizes, torch.Tensor)
        lengths = sizes if isinstance(sizes, torch.Tensor) else to_device(list(sizes), x.device)
        # rows that may end before T: each row's lookahead at its own end
        ends = lengths if on_device or min(sizes) < t else None
        valid = (torch.arange(t, device=x.device)[None, :] < lengths[:, None])[:, None]
        x = self.embed(x)
        if context is not None and context.shape[1]:
            context = self.embed(context)
        pos = positions(cfg.size, x, on_device)
        mask = attention_mask(valid, cfg.static_chunk_size if streaming else 0)
        x = self.pre_lookahead_layer(x, context, ends)
        for layer in self.encoders:
            x = layer(x, mask, pos)
        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)
        lengths = lengths * cfg.up_stride
        t = x.shape[1]
        valid = (torch.arange(t, device=x.device)[None, :] < lengths[:, None])[:, None]
        x = self.up_embed(x)
        pos = positions(cfg.size, x, on_device)
        mask = attention_mask(valid, cfg.static_chunk_size * cfg.up_stride if streaming else 0)
        for layer in self.up_encoders:
            x = layer(x, mask, pos)
        return self.after_norm(x), lengths
