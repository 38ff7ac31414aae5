"""Shadow verification: a sampled fraction of FP16 chunks is recomputed in FP32 and the PSNR
between the two feeds a histogram (and the exported metric), so the quality of FP16 serving
is measured in production, not only in a lab.

A backend is owned by one thread (see `service.backends.base.Backend`), so the FP32 reruns
run on the thread that owns it: `offer` only queues a copy of the inputs, and the engine
thread calls `run_pending` between its steps (one job at a time, so a step is never held up
by more than one chunk's FP32 rerun)."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from service.audio.quality import psnr_db
from service.backends.base import Backend
from service.telemetry.histogram import Histogram
from service.telemetry.telemetry import PSNR_BUCKETS_DB

log = logging.getLogger(__name__)


@dataclass
class _Job:
    backend: Backend
    voice: str  # the voice's name (the PSNR metric's label)
    z_p: np.ndarray  # [C, W'] prior sample with flow context
    keep: tuple[int, int]  # latent frames of the vocoder window inside z_p's latent
    trim: tuple[int, int]  # samples of the chunk inside the vocoder output
    sid: np.ndarray | None
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

    def offer(
        self, backend: Backend, voice: str, z_p: np.ndarray, span: tuple[int, int], halos: tuple[int, int],
        hop: int, sid: np.ndarray | None, audio: np.ndarray,
    ) -> None:
        """`audio` is latent frames `span` of the utterance whose prior sample is `z_p`, made in
        FP16; the FP32 reference is decoded with the full `halos` (flow, vocoder) of context."""
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
        flow_halo, voc_halo = halos
        t = z_p.shape[1]
        v_lo, v_hi = max(0, span[0] - voc_halo), min(t, span[1] + voc_halo)
        a, b = max(0, v_lo - flow_halo), min(t, v_hi + flow_halo)
        job = _Job(
            backend, voice, z_p[:, a:b].copy(), (v_lo - a, v_hi - a),
            ((span[0] - v_lo) * hop, (span[1] - v_lo) * hop), sid, audio.copy(),
        )
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
            z = job.backend.flow(job.z_p[None], job.sid, "fp32")[0][:, job.keep[0] : job.keep[1]]
            ref = job.backend.vocode(z[None], job.sid, "fp32").audio[0][job.trim[0] : job.trim[1]]
            value = psnr_db(ref, job.fp16_audio)
            self.psnr.observe(value)
            with self._lock:
                self.verified += 1
            if self.on_psnr is not None:
                self.on_psnr(value, job.voice)
        except Exception:  # a shadow failure must never reach a caller
            log.exception("shadow verification failed")

    def drain(self) -> None:
        """Verify everything queued, on the calling thread (which must own the backends:
        tests and one-thread callers such as `Synthesizer`)."""
        while self.run_pending(limit=self.max_queue):
            pass

    def close(self) -> None:
        with self._lock:
            self._queue.clear()


__all__ = ["ShadowVerifier"]
