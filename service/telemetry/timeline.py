"""A timeline of the synthesis core's work (`serve --timeline DIR`), for finding where a burst's
time to first audio goes.

The core records each engine iteration's plan, each acoustic-stage call and each decoder step
(launch and landing, with the engine thread's wall and CPU time), and each session's way to its
first audio; the server records when each session's first text came in and its first audio went
out. Times are `time.monotonic()` seconds, one clock for every process of the host, so both
sides line up. Recording appends to a list: cheap enough to leave on under load, unlike
`--profile` (torch.profiler), which slows the core down while it watches it.

Each side writes one JSON-lines file per busy period (from the first session until none is
left) to DIR, `core-PID-N.jsonl` and `api-PID-N.jsonl`; `cadenza timeline DIR` summarises them
(service/telemetry/timeline_summary.py)."""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

log = logging.getLogger(__name__)


# The server's event loop, while client sessions are open, is looked at this often, and each time
# it comes back later than LOOP_LAG_RECORDED_S the lateness is recorded (`loop_lag`): a loop busy
# with other streams takes new streams' first texts late.
LOOP_LAG_PERIOD_S = 0.005
LOOP_LAG_RECORDED_S = 0.002


_SCHEDSTAT = threading.local()  # each thread's own /proc/thread-self/schedstat, kept open


def runqueue_wait_s() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU (the second field of
    Linux's per-thread schedstat); 0 where the kernel does not say. One read of a file each
    thread keeps open (opening it each time cost several times more)."""
    fd = getattr(_SCHEDSTAT, "fd", None)
    if fd == -1:  # not on this system
        return 0.0
    try:
        if fd is None:
            fd = _SCHEDSTAT.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        return int(os.pread(fd, 128, 0).split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        _SCHEDSTAT.fd = -1
        return 0.0


class Timeline:
    """Events of one side (`core` or `api`) of one process; off (records nothing) without a
    directory. Each side records from one thread (the engine thread, the server's event loop),
    except `watch_gc`'s events, which come from whichever thread collects (appending to a list
    is atomic; one collected while a period is written may land in the next file)."""

    MAX_EVENTS = 100_000  # per busy period (tens of MB); later events are dropped (and counted)
    MAX_PERIODS = 200

    def __init__(self, directory: Path | None = None, side: str = "core") -> None:
        self.directory = directory
        self.side = side
        self.periods = 0
        self.dropped = 0
        self._events: list[tuple[float, str, dict[str, object]]] = []
        self._gc_start: float | None = None

    @property
    def on(self) -> bool:
        return self.directory is not None and self.periods < self.MAX_PERIODS

    def add(self, kind: str, **fields: object) -> None:
        if not self.on:
            return
        if len(self._events) >= self.MAX_EVENTS:
            self.dropped += 1
            return
        self._events.append((time.monotonic(), kind, fields))

    def timed(self, kind: str, **fields: object) -> AbstractContextManager[dict[str, object]]:
        """Record `kind` when the block ends, with its start (`s`), the calling thread's CPU
        seconds in it (`cpu`: a thread waiting for the GIL uses none; one spinning on a device
        synchronisation uses it all) and the seconds it was ready to run but had no CPU
        (`ready`: the host's cores were all busy; Linux only, else 0). Wall time less both is
        what the thread slept: the GIL, or a blocking call. The block may add fields to the dict
        it is given. Off, a plain context (the engine thread enters one per step)."""
        return self._timed(kind, fields) if self.on else nullcontext(fields)

    @contextmanager
    def _timed(self, kind: str, fields: dict[str, object]) -> Iterator[dict[str, object]]:
        start, cpu, ready = time.monotonic(), time.thread_time(), runqueue_wait_s()
        try:
            yield fields
        finally:
            self.add(kind, s=start, cpu=time.thread_time() - cpu, ready=runqueue_wait_s() - ready, **fields)

    def watch_gc(self) -> None:
        """Record each garbage collection of this process (`gc`: generation, `s`, collected):
        a collection holds the GIL, so it stops every thread of the process while it runs."""
        if self.on:
            gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.monotonic()
        elif self._gc_start is not None:
            self.add("gc", s=self._gc_start, generation=info.get("generation", -1), collected=info.get("collected", 0))
            self._gc_start = None

    def flush(self) -> Path | None:
        """End the busy period: write its events (if any) and start a new period."""
        if not self._events or self.directory is None:
            self._events.clear()
            return None
        events, self._events = self._events, []
        self.periods += 1
        path = self.directory / f"{self.side}-{os.getpid()}-{self.periods}.jsonl"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with path.open("w", encoding="utf-8") as f:
                for t, kind, fields in events:
                    f.write(json.dumps({"t": t, "k": kind, **fields}) + "\n")
                if self.dropped:
                    f.write(json.dumps({"t": events[-1][0], "k": "dropped", "n": self.dropped}) + "\n")
        except OSError as exc:
            log.warning("cannot write the timeline to %s: %s (--timeline)", path, exc)
            return None
        self.dropped = 0
        return path


__all__ = ["Timeline"]
