"""Kokoro's phoneme-rate encoders and its prosody predictor (StyleTTS2).

* `TextEncoder`: phoneme ids -> the acoustic features the decoder reads (`asr`, once expanded
  to frames).
* `ProsodyPredictor`: PL-BERT features + the prosody half of the style -> frames per phoneme,
  then, at frame rate, F0 and energy (N) curves at twice the frame rate.

A batch holds rows of different lengths padded to the longest, with `lengths` [B]: the LSTMs run
packed (a row's backward pass starts at its own end), convolutions see zeros past a row's end and
the norms take each row's own positions, so each row equals its run alone (the official model's
masking, which it applies to batches as well)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from service.models.kokoro.layers import AdainResBlk1d, AdaLayerNorm, ChannelLayerNorm, frame_mask, masked


def _bilstm(input_size: int, hidden: int) -> nn.LSTM:
    return nn.LSTM(input_size, hidden // 2, num_layers=1, batch_first=True, bidirectional=True)


def run_lstm(lstm: nn.Module, x: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """x [B, N, C] -> [B, N, H]; with `lengths`, packed, and zeros past each row's end."""
    if lengths is None:
        return lstm(x)[0]
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
    out, _ = nn.utils.rnn.pad_packed_sequence(lstm(packed)[0], batch_first=True, total_length=x.shape[1])
    return out


class TextEncoder(nn.Module):
    """Embedding, `depth` x (conv, channel layer norm, LeakyReLU), then a BiLSTM."""

    def __init__(self, channels: int, kernel_size: int, depth: int, n_symbols: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(n_symbols, channels)
        self.cnn = nn.ModuleList(
            nn.Sequential(nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2),
                          ChannelLayerNorm(channels))
            for _ in range(depth)
        )
        self.lstm = _bilstm(channels, channels)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, N] -> features [B, channels, N]."""
        mask = frame_mask(lengths, ids.shape[1])
        x = masked(self.embedding(ids).transpose(1, 2), mask)
        for block in self.cnn:
            x = masked(F.leaky_relu(block(x), 0.2), mask)
        return run_lstm(self.lstm, x.transpose(1, 2), lengths).transpose(1, 2)


class DurationEncoder(nn.Module):
    """`nlayers` x (BiLSTM, AdaLayerNorm); the style is appended to every layer's input and to
    the output. `lstms` alternates the two kinds, as the official module lists them."""

    def __init__(self, style_dim: int, d_model: int, nlayers: int) -> None:
        super().__init__()
        self.lstms = nn.ModuleList()
        for _ in range(nlayers):
            self.lstms.append(_bilstm(d_model + style_dim, d_model))
            self.lstms.append(AdaLayerNorm(style_dim, d_model))

    def forward(self, x: torch.Tensor, style: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, N, d_model], style [B, style_dim] -> [B, N, d_model + style_dim]."""
        s = style.unsqueeze(1).expand(-1, x.shape[1], -1)
        h = torch.cat([x, s], dim=-1)
        for lstm, norm in zip(self.lstms[0::2], self.lstms[1::2], strict=True):
            h = run_lstm(lstm, h, lengths)
            h = torch.cat([norm(h, style), s], dim=-1)
        return h


class LinearNorm(nn.Module):
    """A Linear under the official `linear_layer` name."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear_layer = nn.Linear(in_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_layer(x)


class ProsodyPredictor(nn.Module):
    def __init__(self, style_dim: int, d_hid: int, nlayers: int, max_dur: int) -> None:
        super().__init__()
        half = d_hid // 2
        self.text_encoder = DurationEncoder(style_dim, d_hid, nlayers)
        self.lstm = _bilstm(d_hid + style_dim, d_hid)
        self.duration_proj = LinearNorm(d_hid, max_dur)
        self.shared = _bilstm(d_hid + style_dim, d_hid)
        self.F0 = self._curve_blocks(d_hid, style_dim)
        self.N = self._curve_blocks(d_hid, style_dim)
        self.F0_proj = nn.Conv1d(half, 1, 1)
        self.N_proj = nn.Conv1d(half, 1, 1)

    @staticmethod
    def _curve_blocks(d_hid: int, style_dim: int) -> nn.ModuleList:
        half = d_hid // 2
        return nn.ModuleList([
            AdainResBlk1d(d_hid, d_hid, style_dim),
            AdainResBlk1d(d_hid, half, style_dim, upsample=True),
            AdainResBlk1d(half, half, style_dim),
        ])

    def durations(self, d: torch.Tensor, speed: torch.Tensor | float,
                  lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Duration-encoder output [B, N, C] -> frames per phoneme [B, N] (float, before rounding).

        The projection gives `max_dur` logits per phoneme; the expected duration is the sum of
        their sigmoids (an ordinal code: how many of the thresholds 1..max_dur it passes).
        `speed`: a number, or [B] (one per row)."""
        h = run_lstm(self.lstm, d, lengths)
        if isinstance(speed, torch.Tensor):
            speed = speed.view(-1, 1)
        return torch.sigmoid(self.duration_proj(h)).sum(dim=-1) / speed

    def curves(self, en: torch.Tensor, style: torch.Tensor,
               frames: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Frame-rate features [B, T, C] -> F0 and energy [B, 2T] (`frames` [B]: rows padded to T)."""
        h = run_lstm(self.shared, en, frames).transpose(1, 2)
        mask = frame_mask(frames, h.shape[-1])
        mask2 = frame_mask(None if frames is None else 2 * frames, 2 * h.shape[-1])

        def run(blocks: nn.ModuleList) -> torch.Tensor:
            x, m = h, mask
            for block in blocks:
                x = block(x, style, m, mask2 if block.upsample else None)
                m = mask2 if block.upsample else m
            return x

        f0, n = run(self.F0), run(self.N)
        return self.F0_proj(f0).squeeze(1), self.N_proj(n).squeeze(1)
