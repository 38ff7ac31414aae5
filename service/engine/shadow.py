"""Shadow verification: a sampled fraction of FP16 chunks is recomputed in FP32 and the PSNR
between the two feeds a histogram (and the exported metric), so the quality of FP16 serving
is measured in production, not only in a lab.

The FP32 reference is the family's reference decode (`VoiceRuntime.reference`: the whole
utterance at once, no chunks), so a chunk is checked against what it must equal, not against a
second chunked decoder. A voice is driven by one thread, so the reruns run on the engine thread:
`offer` only queues the job, and the engine thread calls `run_pending` between its steps (one
job at a time, so a step is never held up by more than one utterance's FP32 rerun)."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from service.audio.quality import psnr_db
from service.models.family import DecoderInput, VoiceRuntime
from service.telemetry.histogram import Histogram
from service.telemetry.telemetry import PSNR_BUCKETS_DB

log = logging.getLogger(__name__)


@dataclass
class _Job:
    runtime: VoiceRuntime
    utterance: DecoderInput
    span: tuple[int, int]  # samples of the chunk in the utterance
    fp16_audio: np.ndarray


@dataclass
class ShadowVerifier:
    """Offers are sampled deterministically: every round(1/fraction)-th FP16 chunk.
    The queue is bounded; when the verifier falls behind, offers are dropped
    (counted), never waited for. `on_psnr(db, voice)` is told every measurement."""

    fraction: float = 0.01
    max_queue: int = 32
    psnr: Histogram = field(default_factory=lambda: Histogram("cadenza_shadow_psnr_db", PSNR_BUCKETS_DB))
    on_psnr: Callable[[float, str], None] | None = None
    offered: int = 0
    dropped: int = 0
    verified: int = 0
    _queue: collections.deque[_Job] = field(default_factory=collections.deque, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError("shadow fraction must be within 0..1 (--shadow-fraction)")

    def offer(self, runtime: VoiceRuntime, utterance: DecoderInput, span: tuple[int, int], audio: np.ndarray) -> None:
        """`audio` is samples `span` of `utterance`, made in FP16."""
        if self.fraction <= 0.0:
            return
        with self._lock:
            self.offered += 1
            every = max(1, round(1.0 / self.fraction))
            if self.offered % every:
                return
            if len(self._queue) >= self.max_queue:
                self.dropped += 1
                return
        job = _Job(runtime, utterance, span, audio.copy())
        with self._lock:
            self._queue.append(job)

    @property
    def pending(self) -> int:
        return len(self._queue)

    def run_pending(self, limit: int = 1) -> int:
        """Verify up to `limit` queued chunks, on the calling thread (the one that owns the
        backends); returns how many ran."""
        done = 0
        while done < limit:
            with self._lock:
                if not self._queue:
                    break
                job = self._queue.popleft()
            self._verify(job)
            done += 1
        return done

    def _verify(self, job: _Job) -> None:
        try:
            ref = job.runtime.reference(job.utterance, "fp32")[job.span[0] : job.span[1]]
            value = psnr_db(ref, job.fp16_audio)
            self.psnr.observe(value)
            with self._lock:
                self.verified += 1
            if self.on_psnr is not None:
                self.on_psnr(value, job.runtime.info.name)
        except Exception:  # a shadow failure must never reach a caller
            log.exception("shadow verification failed")

    def drain(self) -> None:
        """Verify everything queued, on the calling thread (which must own the voices: tests)."""
        while self.run_pending(limit=self.max_queue):
            pass

    def close(self) -> None:
        with self._lock:
            self._queue.clear()


__all__ = ["ShadowVerifier"]
