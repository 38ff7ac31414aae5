"""The inverse STFT the vocoders end with, as `torch.istft` computes it (centred, the overlap-add
divided by the windows' summed squares), in plain tensor ops.

`torch.istft` reads the smallest window envelope back to the host to check it, which makes a
CUDA caller wait for every kernel queued before it: a decoder step could not be queued while the
engine thread goes on. Here the check is left out (the vocoders' Hann windows overlap fully) and
nothing leaves the device."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def istft(spec: torch.Tensor, n_fft: int, hop: int, window: torch.Tensor,
          frames: torch.Tensor | None = None) -> torch.Tensor:
    """Complex onesided spectra [B, n_fft // 2 + 1, F] -> signals [B, (F - 1) * hop]. With
    `frames` [B], row b's spectrum ends at frames[b] and its overlap-add is normalised by its own
    frames' windows, as `torch.istft` of that row alone would be."""
    count = spec.shape[-1]
    pieces = torch.fft.irfft(spec.transpose(1, 2), n=n_fft) * window  # [B, F, n_fft]
    squares = window.square().expand(spec.shape[0], count, -1)
    if frames is not None:
        live = (torch.arange(count, device=spec.device) < frames.view(-1, 1)).to(pieces.dtype).unsqueeze(-1)
        pieces, squares = pieces * live, squares * live
    size = (count - 1) * hop + n_fft

    def overlap_add(x: torch.Tensor) -> torch.Tensor:  # [B, F, n_fft] -> [B, size]
        return F.fold(x.transpose(1, 2), (1, size), (1, n_fft), stride=(1, hop)).view(x.shape[0], -1)

    envelope = overlap_add(squares)
    audio = overlap_add(pieces) / torch.where(envelope > 1e-11, envelope, torch.ones_like(envelope))
    half = n_fft // 2
    return audio[:, half:size - half]
