"""Shadow verification: a sampled fraction of FP16 chunks is recomputed in FP32
on a background thread, and the PSNR between the two feeds a histogram, so the
quality of FP16 serving is measured in production, not only in a lab."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

import numpy as np

from service.backends.base import Backend
from service.quality import psnr_db
from service.telemetry.histogram import Histogram

log = logging.getLogger(__name__)

PSNR_BUCKETS_DB = (20.0, 30.0, 40.0, 45.0, 50.0, 55.0, 60.0, 70.0, 80.0, 100.0)


@dataclass
class _Job:
    backend: Backend
    z_p: np.ndarray  # [C, W'] prior sample with flow context
    keep: tuple[int, int]  # latent frames of the vocoder window inside z_p's latent
    trim: tuple[int, int]  # samples of the chunk inside the vocoder output
    sid: np.ndarray | None
    fp16_audio: np.ndarray


@dataclass
class ShadowVerifier:
    """Offers are sampled deterministically: every round(1/fraction)-th FP16 chunk.
    The queue is bounded; when the verifier falls behind, offers are dropped
    (counted), never waited for."""

    fraction: float = 0.01
    max_queue: int = 32
    psnr: Histogram = field(default_factory=lambda: Histogram("cadenza_shadow_psnr_db", PSNR_BUCKETS_DB))
    offered: int = 0
    dropped: int = 0
    verified: int = 0
    _queue: queue.Queue[_Job | None] = field(init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError("shadow fraction must be within 0..1")
        self._queue = queue.Queue(self.max_queue)

    def offer(
        self, backend: Backend, z_p: np.ndarray, span: tuple[int, int], halos: tuple[int, int], hop: int,
        sid: np.ndarray | None, audio: np.ndarray,
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
        flow_halo, voc_halo = halos
        t = z_p.shape[1]
        v_lo, v_hi = max(0, span[0] - voc_halo), min(t, span[1] + voc_halo)
        a, b = max(0, v_lo - flow_halo), min(t, v_hi + flow_halo)
        job = _Job(
            backend, z_p[:, a:b].copy(), (v_lo - a, v_hi - a),
            ((span[0] - v_lo) * hop, (span[1] - v_lo) * hop), sid, audio.copy(),
        )
        self._ensure_thread()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            with self._lock:
                self.dropped += 1

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cadenza-shadow", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                z = job.backend.flow(job.z_p[None], job.sid, "fp32")[0][:, job.keep[0] : job.keep[1]]
                ref = job.backend.vocode(z[None], job.sid, "fp32").audio[0][job.trim[0] : job.trim[1]]
                self.psnr.observe(psnr_db(ref, job.fp16_audio))
                with self._lock:
                    self.verified += 1
            except Exception:  # a shadow failure must never reach a caller
                log.exception("shadow verification failed")
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        """Wait until every queued job is verified (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None


__all__ = ["ShadowVerifier"]
