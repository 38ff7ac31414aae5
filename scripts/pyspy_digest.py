"""Digest of a `py-spy record -f raw` file: per thread, how many samples it was running and where.

A sample counts as waiting when its innermost frame, or its innermost Python frame (with
--native the frames below it are unnamed libc), is a blocking call (a condition, a pipe or
socket read, a queue, a selector); the rest are running: holding the GIL, or (with --native)
waiting to take it back, which shows as `pthread_cond_timedwait` under `gil_scoped_acquire` or
under a Python frame. Threads of one name pattern (the frontend's) are added up.

    python scripts/pyspy_digest.py FILE [--top 8]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

WAITING = ("wait (threading", "select (selectors", "_recv (multiprocessing", "_poll_wrapper", "get (queue",
           "epoll_wait", "poll (", "read (", "recv (",
           # innermost Python frames that wait in C (SimpleQueue.get, grpc's poller): no frame of their own
           "_PipeWriter._run (", "_Outbox._send_all (", "futures/thread.py:", "Thread.run (threading.py")


def _short(frame: str) -> str:
    """`fn (/long/path/pkg/mod.py:12)` -> `fn (mod.py:12)`."""
    return re.sub(r" \((?:/[^)]*/)?([^/)]*)\)", r" (\1)", frame)


def digest(path: str, top: int) -> list[str]:
    running: dict[str, Counter[str]] = defaultdict(Counter)
    totals: Counter[str] = Counter()
    for line in open(path, encoding="utf-8", errors="replace"):
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        thread = re.sub(r"thread \(\d+\): ", "", frames[0])
        thread = re.sub(r"-\d+$", "-N", thread)  # cadenza-frontend-3 -> cadenza-frontend-N
        n = int(count)
        totals[thread] += n
        leaf = _short(frames[-1])
        python = [_short(f) for f in frames if ".py:" in f]
        where = python[-1] if python else "-"
        if any(w in leaf or w in where for w in WAITING):
            continue
        running[thread][where if where == leaf else f"{where} > {leaf}"] += n
    out = []
    for thread, total in totals.most_common():
        busy = sum(running[thread].values())
        out.append(f"{thread}: {total} samples, running in {busy} ({100 * busy / total:.0f}%)")
        out += [f"  {n:6d}  {where[:150]}" for where, n in running[thread].most_common(top)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    print("\n".join(digest(args.file, args.top)))


if __name__ == "__main__":
    main()
