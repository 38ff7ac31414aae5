"""The output stage: delivers chunks to the sessions' event loops, fills and replays the
result cache, retires finished utterances and sessions, and keeps the accounts."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping

import numpy as np

from service.engine.cache import CachedUtterance, ResultCache
from service.engine.state import ChunkResult, Loop, SessionState, SessionStatus, Sink, UtteranceState, UtteranceStatus
from service.telemetry import Telemetry
from service.telemetry.timeline import Timeline

log = logging.getLogger(__name__)

# One result for a session: its sink, the sink's method (on_chunk, on_done, on_error), the arguments.
Delivery = tuple[Sink, str, tuple[object, ...]]


class OutputStage:
    def __init__(self, cache: ResultCache, release: Callable[[SessionState, UtteranceState], None],
                 telemetry: Telemetry | None = None, timeline: Timeline | None = None) -> None:
        self.cache = cache
        self.timeline = timeline or Timeline()
        self._release = release  # gives an utterance's decoder slot back
        self.telemetry = telemetry or Telemetry()
        self._pending: dict[Loop, list[Delivery]] = {}

    def cache_key(self, s: SessionState, u: UtteranceState) -> Hashable | None:
        """Only seeded sessions with the voice's own speakers are cacheable (unseeded audio is meant
        to differ; a voice prompt is the session's alone)."""
        spec, p = s.spec, s.spec.params
        if p.seed is None or spec.voice_prompt is not None or self.cache.max_bytes <= 0:
            return None
        return (spec.voice_name, u.sentence.text, tuple(u.sentence.phoneme_ids), spec.sid, p.length_scale,
                p.options, p.seed, spec.precision, spec.schedule, spec.word_timings)

    def chunk(self, s: SessionState, u: UtteranceState, samples: np.ndarray, precision: str, fallback: bool,
              now: float, pcm16: np.ndarray | None = None) -> None:
        """Deliver one decoded chunk of `s`'s head utterance `u` (and its int16 PCM, where the
        step made it); retire `u` after its last."""
        samples = np.ascontiguousarray(samples, dtype=np.float32)
        spans = u.word_spans if u.chunk_index == 0 else []
        u.chunk_index += 1
        u.samples_done += len(samples)
        if len(samples) or spans:
            self._emit(s, ChunkResult(samples, u.index, spans, precision, fallback, False, pcm16), now)
        if u.cache_key is not None and len(samples):
            # A copy: a chunk is a view of its whole step's audio, which the cache must not keep.
            u.chunks.append(samples.copy() if samples.base is not None else samples)
            u.precisions.append(precision)
        if u.samples_done >= u.frames * s.spec.runtime.hop and u.status is not UtteranceStatus.TOKENS:
            self._retire(s, u, now)
            if u.cache_key is not None:
                self.cache.put(u.cache_key, CachedUtterance(tuple(u.chunks), tuple(u.precisions),
                                                            tuple(u.word_spans)))

    def replay_cached(self, s: SessionState, now: float) -> None:
        """Send cached utterances that reached the head of their session's queue."""
        while s.head is not None and s.head.status is UtteranceStatus.CACHED:
            u = s.utterances[0]
            entry = u.cached
            assert entry is not None
            for k, (samples, precision) in enumerate(zip(entry.chunks, entry.precisions, strict=True)):
                spans = list(entry.word_spans) if k == 0 else []
                self._emit(s, ChunkResult(samples, u.index, spans, precision, False, True), now)
            self._retire(s, u, now)

    def _emit(self, s: SessionState, chunk: ChunkResult, now: float) -> None:
        if s.first_audio_at is None:
            s.first_audio_at = now
            if not s.spec.internal:  # a warm-up's first audio waits for CUDA graph captures
                self.telemetry.first_audio_stages(s.marks.stages(now))
            m = s.marks
            self.timeline.add("first_audio", sid=s.spec.session_id, sent=m.sent, phonemized=m.phonemized,
                              acoustic_start=m.acoustic_start, acoustic_end=m.acoustic_end, step_start=m.step_start)
        s.samples_out += len(chunk.samples)
        s.ready_since = now
        self._deliver(s, "on_chunk", chunk)

    def _retire(self, s: SessionState, u: UtteranceState, now: float) -> None:
        self._release(s, u)
        cached = u.status is UtteranceStatus.CACHED
        u.status = UtteranceStatus.DONE
        s.utterances.popleft()
        self.telemetry.utterance_done(s.spec.session_id, u.index, u.chunk_index, u.frames, len(u.sentence.text),
                                      u.precision, cached, now)

    def finish_if_done(self, s: SessionState) -> bool:
        """End a session whose input ended and whose audio is all out."""
        if s.status is SessionStatus.ACTIVE or s.status is SessionStatus.IDLE:
            if s.done:
                s.status = SessionStatus.FINISHED
                self._deliver(s, "on_done")
                return True
        return False

    def fail(self, s: SessionState, exc: BaseException) -> None:
        self.drop(s, SessionStatus.FAILED)
        self._deliver(s, "on_error", exc)

    def drop(self, s: SessionState, status: SessionStatus) -> None:
        """Free everything a failed or cancelled session holds."""
        s.status = status
        for u in s.utterances:
            self._release(s, u)
            self.telemetry.utterance_dropped(s.spec.session_id, u.index)
        s.utterances.clear()

    def _deliver(self, s: SessionState, method: str, *args: object) -> None:
        """Queued until `flush`, in order: one wake-up of each event loop per flush, not one
        per chunk (each costs the loop a callback and the engine thread a syscall)."""
        self._pending.setdefault(s.spec.loop, []).append((s.spec.sink, method, args))

    def flush(self) -> None:
        """Hand everything delivered since the last flush to the sessions' event loops."""
        pending, self._pending = self._pending, {}
        hand_over(pending)


def hand_over(batches: Mapping[Loop, list[Delivery]]) -> None:
    """Give each loop its deliveries, in order, in one wake-up."""
    for loop, calls in batches.items():
        try:
            loop.call_soon_threadsafe(run_all, calls)
        except RuntimeError:  # the event loop is closed: nobody is listening
            log.debug("event loop closed: %d session callbacks dropped", len(calls))


def run_all(calls: list[Delivery]) -> None:
    """On the event loop: one flush's callbacks, in order; one failing sink does not stop the rest."""
    for sink, method, args in calls:
        try:
            getattr(sink, method)(*args)
        except Exception:
            log.exception("session callback %s failed", method)
