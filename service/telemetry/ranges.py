"""Profiling the synthesis core: named ranges on the engine thread and `BusyProfiler`, which
records the core's busy periods with `torch.profiler` (`--profile DIR` on `serve` and
`bench streams`). Ranges exist only while a profile is being recorded, and then mark stages of
an iteration, never single rows."""

from __future__ import annotations

import json
import logging
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


_NO_RANGE = nullcontext()
_recording = False  # a BusyProfiler of this process is recording


def stage(name: str) -> AbstractContextManager[Any]:
    """A named range while this process is being profiled, else nothing: `record_function`
    costs even with no profiler running (its first uses, milliseconds, on the first audio)."""
    if not _recording:
        return _NO_RANGE
    from torch.profiler import record_function

    return record_function(name)


class BusyProfiler:
    """Records each busy period of the core (from the first open session until none is left,
    or MAX_PERIOD_S) with `torch.profiler`, every thread of the core's process and the device's
    kernels, and writes `core-N.json` (a Chrome trace) and `core-N.txt` (where the time went,
    see service/telemetry/trace_summary.py). Runs on the engine thread: exporting a trace stalls the
    engine, so a period that ends while sessions are still open adds a pause to them."""

    MAX_PERIODS = 4  # traces are tens of MB per second of a loaded GPU
    MAX_PERIOD_S = 5.0

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.periods = 0
        self._prof: Any = None
        self._since = 0.0

    def update(self, busy: bool) -> None:
        now = time.monotonic()
        if self._prof is None:
            if busy and self.periods < self.MAX_PERIODS:
                self._start(now)
        elif not busy or now - self._since >= self.MAX_PERIOD_S:
            self.close()

    def _start(self, now: float) -> None:
        import torch
        from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        try:  # every thread of this process: the frontend's and the pipe's too
            config = _ExperimentalConfig(profile_all_threads=True)
        except TypeError:  # a torch without the option: the engine thread and the device
            config = _ExperimentalConfig()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._prof = profile(activities=activities, experimental_config=config)
        self._prof.__enter__()
        self._since = now
        global _recording
        _recording = True

    def close(self) -> None:
        """End the period being recorded (if any) and write its files."""
        if self._prof is None:
            return
        from service.telemetry.trace_summary import summarise

        global _recording
        _recording = False
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.periods += 1
        trace = self.directory / f"core-{self.periods}.json"
        prof.export_chrome_trace(str(trace))
        summary = self.directory / f"core-{self.periods}.txt"
        summary.write_text("\n".join(summarise(json.loads(trace.read_text()))) + "\n")
        log.info("profile of the core's busy period %d: %s, %s", self.periods, trace, summary)
