"""A decoder step's audio from the device to the host, guarded: shared by the torch backends of
every family."""

from __future__ import annotations

import numpy as np
import torch

from kernels.guard import guard
from service.models.family import HostAudio


def guard_async(audio: torch.Tensor) -> GuardedCopy:
    """The guard over a step's audio [B, S] (one fused kernel on CUDA, which also makes the
    16-bit PCM) and the copies to pinned host memory, queued behind the step on its stream;
    `.result()` waits for them."""
    checked = guard(audio)
    return GuardedCopy(audio, checked.nonfinite, checked.pcm)


class GuardedCopy:
    """A step's audio, its PCM and its guard counts on their way to the host (pinned memory,
    one event). The PCM comes from the device so the core's process does not convert each
    chunk while holding the GIL the engine thread needs for its launches."""

    def __init__(self, audio: torch.Tensor, nonfinite: torch.Tensor, pcm16: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if audio.device.type == "cuda":
            self._audio, self._nonfinite, self._pcm16 = (
                pinned_copy(t) for t in (audio.float(), nonfinite, pcm16))
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._audio, self._nonfinite, self._pcm16 = audio.float(), nonfinite, pcm16

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> HostAudio:
        if self._event is not None:
            self._event.synchronize()
        host, pcm16 = self._audio.numpy(), self._pcm16.numpy()
        if self._event is not None:  # chunks cut from them wait in session queues: leave pinned memory
            host, pcm16 = host.copy(), pcm16.copy()
        nonfinite = self._nonfinite.numpy().astype(np.int64)
        bad = nonfinite > 0
        if bad.any():
            host[bad] = np.nan_to_num(host[bad], nan=0.0, posinf=0.0, neginf=0.0)
        return HostAudio(host, nonfinite, pcm16)


def pinned_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of device tensor `x` in pinned host memory, queued on the current stream."""
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    return host
