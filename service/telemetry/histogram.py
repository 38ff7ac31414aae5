"""A small thread-safe histogram (fixed bucket bounds), exportable later to
OpenTelemetry/Prometheus as explicit-bucket histograms; and the percentile every report uses."""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Histogram:
    name: str
    bounds: tuple[float, ...]  # ascending upper bounds; one overflow bucket after the last
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0
    minimum: float = float("inf")
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(self.bounds):
            raise ValueError("histogram bounds must ascend")
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.bounds, value)] += 1
            self.total += value
            self.count += 1
            self.minimum = min(self.minimum, value)

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {"name": self.name, "bounds": list(self.bounds), "counts": list(self.counts),
                    "sum": self.total, "count": self.count,
                    "min": self.minimum if self.count else None}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
