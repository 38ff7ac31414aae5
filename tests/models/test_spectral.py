"""The vocoders' inverse STFT equals torch.istft, alone and per row of a batch of unequal rows."""

from __future__ import annotations

import pytest
import torch

from service.models.spectral import istft


@pytest.mark.parametrize(("n_fft", "hop"), [(16, 4), (20, 5)])  # CosyVoice2's HiFT, Kokoro's iSTFTNet
def test_istft_equals_torch(n_fft: int, hop: int) -> None:
    gen = torch.Generator().manual_seed(n_fft)
    window = torch.hann_window(n_fft, periodic=True)
    spec = torch.randn(3, n_fft // 2 + 1, 57, dtype=torch.cfloat, generator=gen)
    torch.testing.assert_close(istft(spec, n_fft, hop, window), torch.istft(spec, n_fft, hop, n_fft, window=window),
                               atol=1e-6, rtol=0)
    frames = torch.tensor([57, 30, 10])
    batched = istft(spec, n_fft, hop, window, frames)
    for i, n in enumerate(frames.tolist()):
        alone = torch.istft(spec[i : i + 1, :, :n], n_fft, hop, n_fft, window=window)
        torch.testing.assert_close(batched[i : i + 1, : alone.shape[1]], alone, atol=1e-6, rtol=0)
