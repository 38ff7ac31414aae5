"""NaN/Inf guard for vocoder chunks, fused with peak metering and int16 PCM conversion.

Every chunk is checked before it is encoded: a row with any non-finite sample trips the
guard and is recomputed in FP32 by the engine. `guard` runs the fused CUDA kernel
(kernels/guard.cu) on GPU tensors and the torch reference everywhere else; both do the same
float32 arithmetic, so their results are bit-identical.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

__all__ = ["GuardResult", "guard", "guard_reference"]

log = logging.getLogger(__name__)

PCM_SCALE = 32767.0
_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)
_kernel_broken = False  # set once when the CUDA kernel cannot be used in this process


@dataclass(frozen=True)
class GuardResult:
    """Per-row guard outcome; tensors stay on the input's device (no host sync here).

    nonfinite: int32 [B], count of NaN/Inf samples per row.
    peak: float32 [B], max |x| over the row's finite samples (0 when none).
    pcm: int16 [B, T] (or [T] for 1-D input), clipped PCM with 0 where x was non-finite.
    """

    nonfinite: torch.Tensor
    peak: torch.Tensor
    pcm: torch.Tensor

    def tripped(self) -> list[bool]:
        """Rows that must be redone in FP32 (this syncs with the device)."""
        return [bool(c) for c in (self.nonfinite > 0).tolist()]


def _as_batch(x: torch.Tensor) -> torch.Tensor:
    """View 1-D audio as one row; reject shapes and dtypes the guard does not define."""
    if x.dtype not in _SUPPORTED:
        raise TypeError(f"guard takes float16, bfloat16 or float32 audio, got {x.dtype}")
    if x.dim() == 1:
        return x.unsqueeze(0)
    if x.dim() != 2:
        raise ValueError(f"guard takes [T] or [B, T] audio, got shape {tuple(x.shape)}")
    return x


def guard_reference(x: torch.Tensor) -> GuardResult:
    """Torch-ops guard: the kernel's test oracle and the path for CPU tensors.

    Half inputs are upcast to float32 first (exact), then the kernel's arithmetic is repeated:
    pcm = round_half_even(clamp(x, -1, 1) * 32767) in float32, 0 for non-finite samples.
    """
    batch = _as_batch(x).float()
    finite = torch.isfinite(batch)
    clean = torch.where(finite, batch, torch.zeros((), dtype=batch.dtype, device=batch.device))
    nonfinite = (~finite).sum(dim=-1, dtype=torch.int32)
    if batch.shape[-1] == 0:
        peak = torch.zeros(batch.shape[0], dtype=torch.float32, device=batch.device)
    else:
        peak = clean.abs().amax(dim=-1)
    pcm = torch.round(clean.clamp(-1.0, 1.0) * PCM_SCALE).to(torch.int16)
    return GuardResult(nonfinite=nonfinite, peak=peak, pcm=pcm.reshape(x.shape))


def guard(x: torch.Tensor) -> GuardResult:
    """Guard a chunk batch: fused CUDA kernel for fp16/fp32 GPU tensors, else the reference.

    If the kernel cannot be used (no pycuda, no nvcc, compile error) it is logged once and the
    reference runs instead, so a missing toolkit costs speed, never correctness.
    """
    global _kernel_broken
    batch = _as_batch(x)
    if (
        batch.device.type == "cuda"
        and batch.dtype in (torch.float16, torch.float32)
        and not _kernel_broken
    ):
        from kernels import loader

        if loader.available():
            try:
                nonfinite, peak, pcm = loader.guard_cuda(batch)
            except loader.KernelUnavailable as exc:
                log.warning("CUDA guard kernel unavailable, using torch ops: %s", exc)
                _kernel_broken = True
            else:
                return GuardResult(nonfinite=nonfinite, peak=peak, pcm=pcm.reshape(x.shape))
    return guard_reference(x)
