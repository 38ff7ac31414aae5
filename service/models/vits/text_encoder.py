"""Text encoder: phoneme ids -> prior mean/log-scale per phoneme (transformer with
windowed relative-position self-attention, as in VITS)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class ChannelLayerNorm(nn.Module):
    """Layer norm over the channel axis of a [batch, channels, time] tensor."""

    def __init__(self, channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.channels = channels
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.transpose(1, -1), (self.channels,), self.gamma, self.beta, self.eps)
        return y.transpose(1, -1)


class RelativeSelfAttention(nn.Module):
    """Multi-head self-attention with learned relative-position embeddings for
    offsets in [-window, window]; offsets outside the window get none."""

    def __init__(self, channels: int, n_heads: int, window: int, heads_share: bool) -> None:
        super().__init__()
        assert channels % n_heads == 0, "channels must divide by heads"
        self.n_heads = n_heads
        self.k_channels = channels // n_heads
        self.window = window
        self.conv_q = nn.Conv1d(channels, channels, 1)
        self.conv_k = nn.Conv1d(channels, channels, 1)
        self.conv_v = nn.Conv1d(channels, channels, 1)
        self.conv_o = nn.Conv1d(channels, channels, 1)
        rel_heads = 1 if heads_share else n_heads
        scale = self.k_channels**-0.5
        self.emb_rel_k = nn.Parameter(torch.randn(rel_heads, 2 * window + 1, self.k_channels) * scale)
        self.emb_rel_v = nn.Parameter(torch.randn(rel_heads, 2 * window + 1, self.k_channels) * scale)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        b, c, t = x.shape
        h, d, w = self.n_heads, self.k_channels, self.window
        q = self.conv_q(x).view(b, h, d, t).transpose(2, 3)
        k = self.conv_k(x).view(b, h, d, t).transpose(2, 3)
        v = self.conv_v(x).view(b, h, d, t).transpose(2, 3)
        q = q / math.sqrt(d)
        scores = torch.matmul(q, k.transpose(-2, -1))
        # Relative keys: logits for each in-window offset, then placed at key j-i.
        # A zero row at each end absorbs offsets outside the window.
        pos = torch.arange(t, device=x.device)
        offset = (pos.unsqueeze(0) - pos.unsqueeze(1)).clamp(-w - 1, w + 1) + (w + 1)
        # (The parameters feed the matmuls directly so exporters keep them named.)
        rel_logits = torch.matmul(self.emb_rel_k, q.transpose(-2, -1)).transpose(-2, -1)
        rel_logits = F.pad(rel_logits, (1, 1))
        scores = scores + rel_logits.gather(-1, offset.expand(b, h, t, t))
        scores = scores.masked_fill(attn_mask == 0, -1e4)
        p = torch.softmax(scores, dim=-1)
        out = torch.matmul(p, v)
        # Relative values: weight of offset r for query i is p[i, i + r - w].
        window_idx = pos.unsqueeze(1) + torch.arange(2 * w + 1, device=x.device).unsqueeze(0)
        p_padded = F.pad(p, (w, w))
        rel_weights = p_padded.gather(-1, window_idx.expand(b, h, t, 2 * w + 1))
        out = out + torch.matmul(rel_weights, self.emb_rel_v)
        out = out.transpose(2, 3).reshape(b, c, t)
        return self.conv_o(out)


class FeedForward(nn.Module):
    """Two 'same'-padded convolutions with ReLU, masked between them."""

    def __init__(self, channels: int, filter_channels: int, kernel_size: int) -> None:
        super().__init__()
        self.pad = ((kernel_size - 1) // 2, kernel_size // 2)
        self.conv_1 = nn.Conv1d(channels, filter_channels, kernel_size)
        self.conv_2 = nn.Conv1d(filter_channels, channels, kernel_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.conv_1(F.pad(x * mask, self.pad))
        x = torch.relu(x)
        x = self.conv_2(F.pad(x * mask, self.pad))
        return x * mask


class Encoder(nn.Module):
    """Post-norm transformer stack."""

    def __init__(
        self,
        channels: int,
        filter_channels: int,
        n_heads: int,
        n_layers: int,
        kernel_size: int,
        window: int,
        heads_share: bool,
    ) -> None:
        super().__init__()
        self.attn_layers = nn.ModuleList(
            RelativeSelfAttention(channels, n_heads, window, heads_share) for _ in range(n_layers)
        )
        self.norm_layers_1 = nn.ModuleList(ChannelLayerNorm(channels) for _ in range(n_layers))
        self.ffn_layers = nn.ModuleList(
            FeedForward(channels, filter_channels, kernel_size) for _ in range(n_layers)
        )
        self.norm_layers_2 = nn.ModuleList(ChannelLayerNorm(channels) for _ in range(n_layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attn_mask = mask.unsqueeze(2) * mask.unsqueeze(-1)
        x = x * mask
        for attn, norm1, ffn, norm2 in zip(
            self.attn_layers, self.norm_layers_1, self.ffn_layers, self.norm_layers_2, strict=True
        ):
            x = norm1(x + attn(x, attn_mask))
            x = norm2(x + ffn(x, mask))
        return x * mask


def sequence_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """[batch] lengths -> [batch, max_len] bool mask."""
    return torch.arange(max_len, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


class TextEncoder(nn.Module):
    """Phoneme ids -> hidden states, prior mean and log-scale, mask."""

    def __init__(
        self,
        n_vocab: int,
        out_channels: int,
        hidden_channels: int,
        filter_channels: int,
        n_heads: int,
        n_layers: int,
        kernel_size: int,
        window: int,
        heads_share: bool,
    ) -> None:
        super().__init__()
        self.hidden_channels = hidden_channels
        self.out_channels = out_channels
        self.emb = nn.Embedding(n_vocab, hidden_channels)
        self.encoder = Encoder(
            hidden_channels, filter_channels, n_heads, n_layers, kernel_size, window, heads_share
        )
        self.proj = nn.Conv1d(hidden_channels, out_channels * 2, 1)

    def forward(
        self, ids: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.emb(ids) * math.sqrt(self.hidden_channels)
        x = x.transpose(1, -1)
        mask = sequence_mask(lengths, x.shape[2]).unsqueeze(1).to(x.dtype)
        x = self.encoder(x * mask, mask)
        stats = self.proj(x) * mask
        m, logs = torch.split(stats, self.out_channels, dim=1)
        return x, m, logs, mask
