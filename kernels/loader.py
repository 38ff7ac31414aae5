"""Compiles and launches the CUDA kernels in this folder through pycuda.

Nothing here touches CUDA at import time: pycuda is imported, and guard.cu compiled, on the
first call. The kernels run in PyTorch's own (primary) CUDA context on torch tensors' memory,
ordered after the work already queued on the caller's current torch stream.
"""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["KernelUnavailable", "available", "guard_cuda"]

GUARD_SOURCE = Path(__file__).with_name("guard.cu")
# guard.cu compiled ahead of time (the GPU image's build stage: nvcc -fatbin for its GPU
# architectures plus PTX): loaded when present, so the runtime needs no nvcc.
GUARD_PREBUILT = Path("/opt/cadenza/kernels/guard.fatbin")
THREADS = 256  # must match GUARD_THREADS in guard.cu
SAMPLES_PER_THREAD = 4  # work per thread before adding blocks; keeps blocks busy, grids small
MAX_GRID_Y = 65535
INSTALL_HINT = (
    "the CUDA guard kernel needs pycuda and a CUDA toolkit (nvcc on PATH): "
    "`pip install pycuda`; without them guard() falls back to the torch reference"
)


class KernelUnavailable(RuntimeError):
    """Raised when the CUDA kernel cannot run here (no GPU, no pycuda, no nvcc)."""


@dataclass
class _DeviceKernels:
    """Compiled module for one GPU, plus pycuda streams standing in for torch streams."""

    ctx: Any
    module: Any
    f32: Any
    f16: Any
    streams: dict[int, tuple[Any, torch.cuda.ExternalStream]] = field(default_factory=dict)


_lock = threading.Lock()
_devices: dict[int, _DeviceKernels] = {}


def available() -> bool:
    """True when a GPU and pycuda are present (compilation may still fail on first use)."""
    return torch.cuda.is_available() and importlib.util.find_spec("pycuda") is not None


def _kernels(device: int) -> _DeviceKernels:
    """Compile guard.cu for `device` once, inside PyTorch's primary context."""
    with _lock:
        kernels = _devices.get(device)
        if kernels is not None:
            return kernels
        if not torch.cuda.is_available():
            raise KernelUnavailable("no CUDA GPU is visible to torch; " + INSTALL_HINT)
        try:
            import pycuda.driver as cuda
            from pycuda.compiler import SourceModule
        except ImportError as exc:
            raise KernelUnavailable(INSTALL_HINT) from exc
        torch.cuda.init()  # make the primary context exist and be PyTorch's
        cuda.init()
        ctx = cuda.Device(device).retain_primary_context()
        ctx.push()
        try:
            if GUARD_PREBUILT.is_file():
                module = cuda.module_from_file(str(GUARD_PREBUILT))
            else:
                module = SourceModule(GUARD_SOURCE.read_text(), no_extern_c=True)
            f32 = module.get_function("guard_f32")
            f16 = module.get_function("guard_f16")
        except Exception as exc:
            raise KernelUnavailable(f"loading {GUARD_PREBUILT} or compiling {GUARD_SOURCE.name} failed: {exc}") from exc
        finally:
            ctx.pop()
        f32.prepare("PPPPii")
        f16.prepare("PPPPii")
        kernels = _DeviceKernels(ctx=ctx, module=module, f32=f32, f16=f16)
        _devices[device] = kernels
        return kernels


def _stream_for(kernels: _DeviceKernels, current: torch.cuda.Stream) -> Any:
    """The pycuda stream to launch on so the kernel runs in order with `current`.

    pycuda cannot wrap a foreign stream handle. The legacy default stream (handle 0) is the
    same stream for pycuda (None); any other torch stream gets a pycuda twin, created once,
    which waits for `current` before the launch and which `current` waits for after it.
    """
    handle = current.cuda_stream
    if handle == 0:
        return None
    twin = kernels.streams.get(handle)
    if twin is None:
        import pycuda.driver as cuda

        stream = cuda.Stream()
        twin = (stream, torch.cuda.ExternalStream(stream.handle, device=current.device))
        kernels.streams[handle] = twin
    twin[1].wait_stream(current)
    return twin[0]


def guard_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the fused guard on a CUDA [B, T] float16/float32 batch.

    Returns (nonfinite int32 [B], peak float32 [B], pcm int16 [B, T]), all on x's device and
    ordered on the current torch stream (no host synchronisation).
    """
    if x.device.type != "cuda":
        raise KernelUnavailable(f"guard_cuda needs a CUDA tensor, got one on {x.device}")
    if x.dtype not in (torch.float16, torch.float32):
        raise TypeError(f"guard_cuda takes float16 or float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"guard_cuda takes a [B, T] batch, got shape {tuple(x.shape)}")
    rows, n = x.shape
    if n >= 2**31 - 2**20:
        raise ValueError(f"rows of {n} samples are too long for the kernel's int indices")
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    kernels = _kernels(device)
    x = x.contiguous()
    stats = torch.zeros(2, rows, dtype=torch.int32, device=x.device)
    pcm = torch.empty(rows, n, dtype=torch.int16, device=x.device)
    if rows > 0 and n > 0:
        per_block = THREADS * SAMPLES_PER_THREAD * (2 if x.dtype == torch.float16 else 1)
        grid = (max(1, -(-n // per_block)), min(rows, MAX_GRID_Y), 1)
        func = kernels.f16 if x.dtype == torch.float16 else kernels.f32
        current = torch.cuda.current_stream(x.device)
        kernels.ctx.push()
        try:
            stream = _stream_for(kernels, current)
            func.prepared_async_call(
                grid,
                (THREADS, 1, 1),
                stream,
                x.data_ptr(),
                pcm.data_ptr(),
                stats[0].data_ptr(),
                stats[1].data_ptr(),
                rows,
                n,
            )
        finally:
            kernels.ctx.pop()
        if stream is not None:
            current.wait_stream(kernels.streams[current.cuda_stream][1])
    return stats[0], stats[1].view(torch.float32), pcm
