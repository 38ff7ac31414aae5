"""Resolving a session's precision: AUTO looks at the hardware, the load and the
trip history, and says why it chose what it chose."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrecisionPolicyConfig:
    """When AUTO picks FP16.

    load_fp16_threshold: on hardware without fast FP16, switch to FP16 anyway
      once this many sessions are live (half the memory and bandwidth).
    trip_window_s / voice_trip_limit: a voice that tripped the guard this many
      times within the window runs FP32 for AUTO sessions until it calms down."""

    load_fp16_threshold: int = 64
    trip_window_s: float = 600.0
    voice_trip_limit: int = 3


@dataclass(frozen=True)
class Hardware:
    device: str  # "cpu", "cuda", "cuda:0"
    fast_fp16: bool  # tensor cores (compute capability >= 7.0)
    name: str = ""

    @staticmethod
    def detect(device: str) -> Hardware:
        if not device.startswith("cuda"):
            return Hardware(device, False, "cpu")
        import torch

        index = torch.device(device).index or 0
        major, minor = torch.cuda.get_device_capability(index)
        return Hardware(device, major >= 7, f"{torch.cuda.get_device_name(index)} (sm_{major}{minor})")


@dataclass(frozen=True)
class PrecisionDecision:
    precision: str  # "fp16" | "fp32" | "int8"
    reason: str


@dataclass
class PrecisionPolicy:
    """One per engine: the hardware and the guard-trip history are the server's; what a voice
    runs (`supported`) comes with each question, since voices of several families differ."""

    hardware: Hardware
    config: PrecisionPolicyConfig = field(default_factory=PrecisionPolicyConfig)
    _trips: dict[str, deque[float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record_trip(self, voice: str, now: float | None = None) -> None:
        with self._lock:
            self._trips.setdefault(voice, deque(maxlen=64)).append(time.monotonic() if now is None else now)

    def recent_trips(self, voice: str, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        with self._lock:
            return sum(1 for t in self._trips.get(voice, ()) if now - t <= self.config.trip_window_s)

    def resolve(
        self, requested: str, voice: str, supported: tuple[str, ...], live_sessions: int,
        now: float | None = None,
    ) -> PrecisionDecision:
        """`requested` is "auto", "fp16", "fp32" or "int8"; `supported`: what `voice` runs as
        loaded. Explicit requests are honoured (the caller validates them against `supported`);
        AUTO picks among `supported` only."""
        requested = requested.lower()
        if requested in ("fp16", "fp32", "int8"):
            return PrecisionDecision(requested, "requested by the client")
        if "int8" in supported:
            return PrecisionDecision("int8", "the server was started with --int8")
        if "fp16" not in supported:
            return PrecisionDecision("fp32", f"voice {voice} runs {', '.join(supported)} only")
        trips = self.recent_trips(voice, now)
        if trips >= self.config.voice_trip_limit:
            return PrecisionDecision(
                "fp32", f"voice {voice} tripped the NaN/Inf guard {trips} times in the last "
                f"{self.config.trip_window_s:.0f} s")
        if self.hardware.fast_fp16:
            return PrecisionDecision("fp16", f"{self.hardware.name} has tensor cores")
        if live_sessions >= self.config.load_fp16_threshold:
            return PrecisionDecision(
                "fp16", f"{live_sessions} live sessions >= {self.config.load_fp16_threshold}: FP16 halves memory")
        return PrecisionDecision("fp32", f"{self.hardware.name or self.hardware.device}: no fast FP16")
