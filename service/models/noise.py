"""Counter-based Gaussian noise: sample (t, c) of an utterance is a pure function of the
utterance's key and t * channels + c.

The prior sample of a streaming decoder is drawn on the device, inside each batched step,
for whatever rows and frames that step covers. A stateful generator cannot do that (its
stream depends on the order of the draws); a hash of (key, counter) can, and gives the same
numbers on the host and on any device, for any step size and any batch. This is the approach
of counter-based generators (Philox, Threefry); the mixing function is SplitMix64's.

Two 24-bit uniforms from one 64-bit hash give one normal by Box-Muller (tails cut at about
5.8 sigma, far beyond what a prior sample needs)."""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_U24 = float(1 << 24)


def _i64(value: int) -> int:
    """A 64-bit constant as torch's (signed, wrapping) int64."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser, in wrapping int64 arithmetic."""
    x = x ^ _shr(x, 30)
    x = x * _i64(_MUL1)
    x = x ^ _shr(x, 27)
    x = x * _i64(_MUL2)
    return x ^ _shr(x, 31)


def counter_normal(keys: torch.Tensor, starts: torch.Tensor, channels: int, frames: int) -> torch.Tensor:
    """[B, channels, frames] float32 standard normals for rows with `keys` [B] (int64), frames
    `starts[i]` .. `starts[i] + frames - 1` of each row's sequence."""
    dev = keys.device
    t = starts.to(torch.int64).view(-1, 1, 1) + torch.arange(frames, device=dev, dtype=torch.int64).view(1, 1, -1)
    c = torch.arange(channels, device=dev, dtype=torch.int64).view(1, -1, 1)
    h = _mix(_mix(keys.to(torch.int64)).view(-1, 1, 1) + (t * channels + c) * _i64(_GOLDEN))
    u1 = (_shr(h, 40).to(torch.float32) + 0.5) / _U24  # (0, 1): log is finite
    u2 = (_shr(h, 16) & 0xFFFFFF).to(torch.float32) / _U24
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * torch.pi) * u2)
