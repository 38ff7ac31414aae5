"""Host values onto the device without making the host wait.

A copy from pageable host memory (`torch.tensor(values, device=...)`, `.to(device)`) first waits
for everything queued on the device's current stream: the engine thread stalls until the step
before is done, and nothing else (a token step, the next plan) is queued meanwhile. From pinned
memory the copy is queued behind that work instead."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def pinned(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`values` as a host tensor a non-blocking copy to `device` can read (pinned on CUDA)."""
    t = values if isinstance(values, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(values))
    return t.pin_memory() if device.type == "cuda" and t.device.type == "cpu" else t


def to_device(values: torch.Tensor | np.ndarray | Sequence[int] | Sequence[Sequence[int]], device: torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` on `device`; from the host, queued behind the stream's work on CUDA rather than waiting for it."""
    if isinstance(values, torch.Tensor):
        host = values
    elif isinstance(values, np.ndarray):
        host = torch.from_numpy(np.ascontiguousarray(values))
    else:
        host = torch.tensor(values)
    if dtype is not None:
        host = host.to(dtype)
    return pinned(host, device).to(device, non_blocking=True)
