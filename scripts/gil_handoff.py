"""What one busy Python thread does to the engine thread's native calls, on any machine.

Most torch calls give the GIL up while they run in C++ and take it back after; while another
thread of the process runs Python, taking it back can wait for that thread's switch interval.
This times a few calls the engine thread makes per step, alone and next to one thread that
spins in Python, for each switch interval given.

    .venv/bin/python scripts/gil_handoff.py [--intervals-us 500,50] [--calls 2000]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals-us", default="500,50", help="switch intervals to try (microseconds)")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls of each kind")
    args = parser.parse_args()
    batch = torch.zeros(64, 2, 192, 256)
    small = torch.zeros(10)
    host = np.zeros(1000, np.int64)
    calls: dict[str, Callable[[], object]] = {
        "a view: batch[row, :, :, :n]": lambda: batch[3, :, :, :100],
        "torch.empty(10)": lambda: torch.empty(10),
        "torch.from_numpy": lambda: torch.from_numpy(host),
        "small.add_(1)": lambda: small.add_(1),
        "storage().data_ptr()": lambda: batch.untyped_storage().data_ptr(),
        "np.zeros(100) (numpy)": lambda: np.zeros(100),
    }
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(100))

    for interval_us in (float(v) for v in args.intervals_us.split(",")):
        sys.setswitchinterval(interval_us / 1e6)
        alone = {k: _per_call_us(f, args.calls) for k, f in calls.items()}
        stop.clear()
        spinner = threading.Thread(target=spin, daemon=True)
        spinner.start()
        busy = {k: _per_call_us(f, max(1, args.calls // 5)) for k, f in calls.items()}
        stop.set()
        spinner.join()
        print(f"switch interval {interval_us:g} us: per call, alone -> next to a busy Python thread")
        for k in calls:
            print(f"  {k:30s} {alone[k]:8.2f} us -> {busy[k]:8.2f} us ({busy[k] / alone[k]:5.1f}x)")


if __name__ == "__main__":
    main()
