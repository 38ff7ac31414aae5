"""Micro-benchmark: fused CUDA guard kernel vs the torch-ops reference, per vocoder chunk batch.

Run on a GPU host from the repo root: `python3 kernels/bench_guard.py [--rows 64 --samples 8192]`.
GPU time per call is the median of CUDA-event timings over many calls after a warm-up; host
time per call is wall-clock over a burst of calls, synchronised at the end (launch overhead).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import loader
from kernels.guard import guard_reference


def gpu_median_us(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median GPU time of one call, in microseconds, from CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e3


def host_us(fn: Callable[[], object], iters: int) -> float:
    """Wall-clock per call over a burst of calls (what the engine loop pays)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=50)
    args = ap.parse_args()

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"batch {args.rows} x {args.samples} samples, median of {args.iters} calls")
    header = f"{'dtype':8} {'kernel us':>10} {'torch us':>10} {'speedup':>8} "
    print(header + f"{'kernel GB/s':>12} {'host k us':>10} {'host t us':>10}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(args.rows, args.samples, device="cuda", generator=g) * 0.7
        x.view(-1)[::9973] = float("nan")
        x = x.to(dtype)
        got = loader.guard_cuda(x)
        want = guard_reference(x)
        exact = (
            torch.equal(got[0], want.nonfinite)
            and torch.equal(got[1].view(torch.int32), want.peak.view(torch.int32))
            and torch.equal(got[2], want.pcm)
        )
        k_us = gpu_median_us(functools.partial(loader.guard_cuda, x), args.iters, args.warmup)
        t_us = gpu_median_us(functools.partial(guard_reference, x), args.iters, args.warmup)
        kh_us = host_us(functools.partial(loader.guard_cuda, x), args.iters)
        th_us = host_us(functools.partial(guard_reference, x), args.iters)
        moved = x.numel() * (x.element_size() + 2)  # read audio, write int16 PCM
        name = str(dtype).removeprefix("torch.")
        print(
            f"{name:8} {k_us:10.1f} {t_us:10.1f} {t_us / k_us:7.1f}x {moved / k_us / 1e3:12.0f} "
            f"{kh_us:10.1f} {th_us:10.1f}  bit-exact={exact}"
        )


if __name__ == "__main__":
    main()
