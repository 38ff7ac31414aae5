"""The engine core: one thread that loops plan -> execute -> deliver.

Sessions post text, end and cancel messages from their event loops (`submit_*`; with the core
in its own process, the thread that reads the server's pipe posts them, see proc.py); text is
phonemised off this thread first (a text frontend is slow next to the GPU, and espeak is process-global). The
thread applies the messages, asks the scheduler for a plan, has the executor run it and the
output stage deliver it. It is the only code that calls the backends; nothing mutable is
shared with the event loops."""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from service.engine.cache import ResultCache
from service.engine.config import BatchConfig
from service.engine.contract import ENGINE_DIED, ResourceExhausted
from service.engine.executor import Chunk, Executor
from service.engine.frontend_pool import FrontendPool, FrontendPoolConfig
from service.engine.output import OutputStage
from service.engine.scheduler import AcousticCost, Scheduler
from service.engine.shadow import ShadowVerifier
from service.engine.state import (
    EngineStats,
    SessionState,
    SessionStatus,
    UtteranceState,
    WorkSpec,
)
from service.telemetry import Telemetry
from service.telemetry.ranges import BusyProfiler, stage
from service.telemetry.timeline import Timeline
from service.text.frontend import PhonemizedSentence

log = logging.getLogger(__name__)


@dataclass
class _Inbox:
    """Messages for the engine thread, in arrival order (guarded by the core's condition)."""

    items: list[tuple[str, int, object]] = field(default_factory=list)


class EngineCore:
    """Owns the backends from its own thread; sessions talk to it through `submit_*`."""

    def __init__(
        self, batch: BatchConfig, cache: ResultCache, on_trip: Callable[[str], None] | None = None,
        shadow: ShadowVerifier | None = None, frontend: FrontendPoolConfig | None = None,
        telemetry: Telemetry | None = None, profile_dir: Path | None = None, timeline: Timeline | None = None,
    ) -> None:
        self.batch = batch
        self.profiler = BusyProfiler(profile_dir) if profile_dir is not None else None
        self.telemetry = telemetry or Telemetry()
        self.shadow = shadow
        # FP32 reruns, on this thread between steps
        self._shadow_run = shadow.run_pending if shadow is not None else None
        self.frontend_config = frontend or FrontendPoolConfig()
        self.stats = EngineStats()
        self.scheduler = Scheduler(batch)
        self.timeline = timeline or Timeline()
        self.timeline.watch_gc()  # this process's collections (the server records its own in process mode)
        self.executor = Executor(batch, self.stats, shadow, on_trip, self.timeline)
        self.output = OutputStage(cache, self.executor.release, self.telemetry, self.timeline)
        self._cv = threading.Condition()
        self._inbox = _Inbox()
        self._sessions: dict[int, SessionState] = {}  # engine thread only
        self._stopping = False
        self._poked = False  # a client took audio since the last plan
        self._first_audio_wait_s = 0.0
        self._acoustic_cost = AcousticCost()  # the scheduler's estimate of the stage's time per sentence
        # Throughput window: (start, busy seconds, audio seconds, steps, rows) at its start.
        self._window: tuple[float, float, float, int, int] | None = None
        self._busy_share = 0.0  # of the last closed window
        self._specs: dict[int, WorkSpec] = {}  # for the frontend thread (guarded by _cv)
        self._texts_sent: dict[int, int] = {}  # per session: texts handed to the frontend (loop side)
        self._frontend: FrontendPool | None = None
        self._thread = threading.Thread(target=self._run, name="cadenza-engine", daemon=True)
        self.dead = threading.Event()  # the thread ended without stop(): nothing will be synthesised
        self.death: BaseException | None = None  # why

    # --- any thread ------------------------------------------------------------------------------

    def start(self) -> None:
        sys.setswitchinterval(self.batch.gil_switch_interval_s)  # process-wide: see BatchConfig
        self._frontend = FrontendPool(self.frontend_config)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.ident is not None:  # a start-up that failed before it (a voice that would not load)
            self._thread.join(timeout)
        if self._frontend is not None:
            self._frontend.close()

    def _post(self, kind: str, session_id: int, payload: object = None) -> None:
        with self._cv:
            self._inbox.items.append((kind, session_id, payload))
            self._cv.notify()

    def submit_open(self, spec: WorkSpec) -> None:
        with self._cv:
            self._specs[spec.session_id] = spec
        self._texts_sent[spec.session_id] = 0
        self._post("open", spec.session_id, spec)

    def submit_text(self, session_id: int, text: str) -> None:
        """Phonemised off the engine thread (a session's first text ahead of others' later
        ones), then queued for the acoustic stage in the order it was sent."""
        seq = self._texts_sent.get(session_id, 0)
        self._texts_sent[session_id] = seq + 1
        assert self._frontend is not None, "start() the engine first"
        with self._cv:
            spec = self._specs.get(session_id)
        if spec is None:
            return
        future = self._frontend.submit(spec.runtime.info.frontend_key, text, spec.custom_dictionary,
                                       priority=seq, words=spec.word_timings)
        sent = time.monotonic()
        future.add_done_callback(lambda f: self._phonemized(session_id, seq, text, sent, f))

    def submit_end(self, session_id: int) -> None:
        """No more text: carries how many texts came before it, so it is applied after them."""
        self._post("end", session_id, self._texts_sent.pop(session_id, 0))

    def poke(self) -> None:
        """A client took audio: sessions held back by backpressure may step again."""
        with self._cv:
            self._poked = True
            self._cv.notify()

    def submit_cancel(self, session_id: int) -> None:
        self._texts_sent.pop(session_id, None)
        with self._cv:
            self._specs.pop(session_id, None)
        self._post("cancel", session_id)

    def _phonemized(self, session_id: int, seq: int, text: str, sent: float,
                    future: Future[list[PhonemizedSentence]]) -> None:
        """Frontend done (on a frontend thread): hand the sentences to the engine thread."""
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            from service.engine.contract import InvalidArgument

            self._post("error", session_id, InvalidArgument("text", f"cannot phonemise {text[:40]!r}: {exc}"))
            return
        self._post("text", session_id, (seq, sent, time.monotonic(), [s for s in future.result() if s.phoneme_ids]))

    def reset_rate(self) -> None:
        """Forget the decoder's measured speed so far (first runs are slower than serving); the
        staged speed of the run that ends here is kept as one sample of the warm-up's."""
        self.executor.sample_rate()
        self.stats.step_seconds = self.stats.audio_seconds = self.stats.acoustic_seconds = 0.0

    def first_audio_wait(self) -> float:
        """The longest any session waited for its first audio at the last iteration (seconds;
        admission control reads it from the event loop)."""
        return self._first_audio_wait_s

    @property
    def active_work(self) -> int:
        """Sessions the engine thread still holds state for (0 once all are finished or cancelled)."""
        with self._cv:
            return len(self._sessions) + sum(1 for k, _, _ in self._inbox.items if k == "open")

    # --- engine thread ---------------------------------------------------------------------------

    MAX_FAILED_ITERATIONS = 50  # in a row: the thread gives up (see `dead`)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # outside the per-iteration guard: the engine is dead
            self._die(exc)

    def _serve(self) -> None:
        idle, wake_at, failures = True, None, 0
        while True:
            with self._cv:
                if not self._inbox.items and not self._stopping and not self._poked and idle:
                    timeout = None if wake_at is None else max(0.0, wake_at - time.monotonic())
                    self._cv.wait(timeout)
                items, self._inbox.items = self._inbox.items, []
                self._poked = False
                stopping = self._stopping
            with stage("engine.apply"):
                self._apply(items)
            if stopping:
                for s in list(self._sessions.values()):
                    self._fail(s, RuntimeError("engine stopped"))
                self.output.flush()
                self.timeline.flush()  # a busy period cut by the stop is kept too
                if self.profiler is not None:
                    self.profiler.close()
                return
            self._profile()
            try:
                t0 = time.monotonic()
                idle, wake_at = self._iterate()
                self._note_busy(0.0 if idle else time.monotonic() - t0)
                failures = 0
            except Exception:  # a bug here must not kill the thread silently
                log.exception("engine iteration failed")
                failures += 1
                if failures >= self.MAX_FAILED_ITERATIONS:
                    raise
                idle, wake_at = True, time.monotonic() + 0.01
            finally:
                self.output.flush()
            self._profile()

    def _profile(self) -> None:
        """Start or end a profiled busy period: busy while a client session (not warm-up) is open."""
        if self.profiler is not None:
            self.profiler.update(busy=any(not s.spec.internal for s in self._sessions.values()))

    # The engine's throughput is measured over windows of this much wall time, and only from
    # windows in which the thread worked at least BUSY_SHARE of it: a lightly loaded engine
    # makes small batches and would understate what it carries when full.
    # ... and steps of FULL_ROWS rows on average (a few sessions running ahead of playback keep
    # the thread busy too, with batches too small to say what it carries).
    RATE_WINDOW_S = 2.0
    BUSY_SHARE = 0.7
    FULL_ROWS = 16

    def _note_busy(self, seconds: float) -> None:
        now, st = time.monotonic(), self.stats
        if self._window is None:
            self._window = (now, 0.0, st.audio_seconds, st.steps, st.rows)
            return
        start, busy, audio, steps, rows = self._window
        busy += seconds
        self._window = (start, busy, audio, steps, rows)
        wall = now - start
        if wall < self.RATE_WINDOW_S:
            return
        self._busy_share = busy / wall
        n = st.steps - steps
        if busy >= self.BUSY_SHARE * wall and n and (st.rows - rows) / n >= self.FULL_ROWS:
            rate = (st.audio_seconds - audio) / busy
            old = self.executor.engine_rate
            self.executor.engine_rate = rate if not old else 0.7 * old + 0.3 * rate
        self._window = (now, 0.0, st.audio_seconds, st.steps, st.rows)

    def busy_share(self) -> float:
        """The share of its time the engine thread worked over about the last `RATE_WINDOW_S`
        (an idle thread closes no window: then the open one, once it is that long, says it)."""
        window = self._window
        if window is None:
            return 0.0
        wall = time.monotonic() - window[0]
        return window[1] / wall if wall >= self.RATE_WINDOW_S else self._busy_share

    def _die(self, exc: BaseException) -> None:
        """Record the death and fail what this thread still holds (the event loop side fails
        every open session too: see `TtsEngine.fail_all`)."""
        log.critical("the engine thread died: %r", exc, exc_info=exc)
        self.death = exc
        self.dead.set()
        for s in list(self._sessions.values()):
            try:
                self._fail(s, RuntimeError(ENGINE_DIED))
            except Exception:  # best effort: the loop side fails them anyway
                log.exception("could not fail a session after the engine thread died")
        self.output.flush()

    def _apply(self, items: list[tuple[str, int, object]]) -> None:
        now = time.monotonic()
        for kind, sid, payload in items:
            if kind == "open":
                assert isinstance(payload, WorkSpec)
                seed = payload.params.seed
                rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little")) if seed is None else None
                if not payload.internal:  # serving begins: the warm-up's measurements stand
                    self.executor.freeze_rate()
                self._sessions[sid] = _Tracked(payload, rng, ready_since=now)
                self.timeline.add("open", sid=sid)
                continue
            s = self._sessions.get(sid)
            if s is None:
                continue
            assert isinstance(s, _Tracked)
            if kind == "text":
                assert isinstance(payload, tuple)
                seq, sent, done, sentences = payload
                self.timeline.add("text", sid=sid, seq=seq, sentences=len(sentences), sent=sent, phonemized=done)
                s.arrived[seq] = (sent, done, sentences)
                while s.applied in s.arrived:
                    sent, done, sentences = s.arrived.pop(s.applied)
                    s.phonemes += sum(len(x.phonemes) for x in sentences)
                    if s.spec.max_phonemes is not None and s.phonemes > s.spec.max_phonemes:
                        self._fail(s, ResourceExhausted(
                            f"the session's text came to more than {s.spec.max_phonemes} phonemes, the most one "
                            "session may speak; open a new session for more text"))
                        break
                    if s.marks.sent is None and sentences:
                        s.marks.sent, s.marks.phonemized = sent, done
                    for sentence in sentences:
                        s.utterances.append(UtteranceState(s.next_index, sentence))
                        self.telemetry.utterance_queued(sid, s.next_index, now)
                        s.next_index += 1
                    s.applied += 1
                if sid not in self._sessions:
                    continue
                s.status = SessionStatus.ACTIVE
                s.ready_since = now
                if s.first_text_at is None and s.utterances:
                    s.first_text_at = now
            elif kind == "end":
                assert isinstance(payload, int)
                s.end_after = payload
            elif kind == "error":
                assert isinstance(payload, BaseException)
                self._fail(s, payload)
            elif kind == "cancel":
                self.output.drop(s, SessionStatus.CANCELLED)
                del self._sessions[sid]
            if s.end_after is not None and s.applied >= s.end_after:
                s.ended = True

    def _iterate(self) -> tuple[bool, float | None]:
        """One plan -> execute -> deliver round. Returns (idle, when to wake without input)."""
        now = time.monotonic()
        waits = [now - s.first_text_at for s in self._sessions.values()
                 if s.first_audio_at is None and s.first_text_at is not None]
        self._first_audio_wait_s = max(waits, default=0.0)
        stall_check = self._end_stalled(now)
        for s in list(self._sessions.values()):
            self.output.replay_cached(s, now)
            self._finish_if_done(s)
        sessions = list(self._sessions.values())
        runtime = sessions[0].spec.runtime if sessions else None
        max_rows = self.executor.max_rows(runtime)
        free = self.executor.free_slots if runtime is not None and self.executor.uses_slots(runtime) else None
        fill = self.executor.fill_rows(runtime) if runtime is not None else 0
        with stage("engine.plan"):
            plan = self.scheduler.plan(sessions, now, max_rows, free, self._acoustic_cost.per_sentence, fill)
        if plan.empty:
            if not self._sessions:
                self.timeline.flush()  # the busy period is over
            if self._shadow_run is not None and self._shadow_run():
                return False, None
            wakes = [t for t in (plan.wake_at, stall_check) if t is not None]
            return True, min(wakes) if wakes else None
        if self.timeline.on:
            self.timeline.add("plan", sessions=len(sessions), acoustic=len(plan.acoustic),
                              acoustic_first=sum(u.index == 0 for _, u in plan.acoustic), decode=len(plan.decode),
                              decode_first=sum(u.chunk_index == 0 for _, u in plan.decode))
        if plan.tokens:
            self._tokens(plan.tokens)
        if plan.decode and plan.acoustic and runtime is not None and self.executor.overlaps(runtime):
            # The device runs the step while this thread runs the acoustic stage (on its own
            # stream); the sentences that stage readied start in a step of their own right after.
            jobs = plan.acoustic
            self.stats.overlapped += 1
            self._decode(plan.decode, meanwhile=lambda: self._acoustic(jobs))
            self._start_fresh(jobs, max_rows, free)
        elif plan.decode_first:
            self._decode(plan.decode)
            self._acoustic(plan.acoustic)
        else:
            self._acoustic(plan.acoustic)
            if plan.acoustic:  # sentences that just got their decoder input start now
                plan = self.scheduler.plan(list(self._sessions.values()), time.monotonic(), max_rows, free,
                                           self._acoustic_cost.per_sentence, fill)
            self._decode(plan.decode)
        for s in list(self._sessions.values()):
            self._finish_if_done(s)
        if self._shadow_run is not None:
            self._shadow_run()
        return False, None

    def _tokens(self, rows: list[tuple[SessionState, UtteranceState]]) -> None:
        self.stats.token_steps += 1
        for s, why in self.executor.tokens(rows):
            self._fail(s, why)

    def _tokens_meanwhile(self) -> bool:
        """One autoregressive step while a decoder step is still on the device (False: nothing
        makes tokens): a decoder step can take as long as dozens of token steps, and every
        session's next chunk waits for its tokens."""
        rows = self.scheduler.token_rows(self._sessions.values(), time.monotonic())
        if not rows:
            return False
        self.stats.token_steps_overlapped += 1
        self._tokens(rows)
        return True

    def _start_fresh(self, jobs: list[tuple[SessionState, UtteranceState]], max_rows: int,
                     free: Callable[[SessionState, UtteranceState], int] | None) -> None:
        """Step the utterances that just came out of the acoustic stage (their first chunks);
        the other sessions were stepped already this iteration."""
        fresh = {id(u) for _, u in jobs}
        plan = self.scheduler.plan(list(self._sessions.values()), time.monotonic(), max_rows, free,
                                   self._acoustic_cost.per_sentence)
        self._decode([(s, u) for s, u in plan.decode if id(u) in fresh])

    def _end_stalled(self, now: float) -> float | None:
        """End sessions held back by backpressure whose client has taken no audio for
        `stall_timeout_s` (their queued audio is freed); returns when to look again. The clock
        restarts whenever the client reads: a fast reader of long audio is never cut, however
        large one chunk is next to `max_ahead_s`."""
        from service.engine.contract import ClientStalled

        limit, check = self.batch.stall_timeout_s, None
        for s in list(self._sessions.values()):
            held, read = bool(s.utterances) and s.unread_s() >= self.batch.max_ahead_s, s.spec.cursor.read_s
            if not held or read != s.read_at_hold:
                s.held_since, s.read_at_hold = None, read
            if not held:
                continue
            if s.held_since is None:
                s.held_since = now
            if now - s.held_since >= limit:
                self._fail(s, ClientStalled(
                    f"the client took no audio for {limit:.0f} s with {s.unread_s():.1f} s of audio waiting for it; "
                    "the stream is closed (read the audio as it arrives)"))
            else:
                check = min(check or math.inf, s.held_since + limit)
        return check

    def _acoustic(self, jobs: list[tuple[SessionState, UtteranceState]]) -> None:
        if not jobs:
            return
        start = time.monotonic()
        first = sum(u.index == 0 for _, u in jobs) if self.timeline.on else 0
        with stage("engine.acoustic"), self.timeline.timed("acoustic", sentences=len(jobs), first=first):
            failed = self.executor.acoustic(jobs, self.output.cache_key, self.output.cache.get)
        for s, why in failed:
            self._fail(s, why)
        now = time.monotonic()
        self.stats.acoustic_seconds += now - start
        self._acoustic_cost.add(now - start, len(jobs))
        self.telemetry.acoustic_step([(s.spec.session_id, u.index) for s, u in jobs], start, now)
        for s, u in jobs:
            s.ready_since = now
            if u.index == 0:
                s.marks.acoustic_start, s.marks.acoustic_end = start, now

    def _decode(self, rows: list[tuple[SessionState, UtteranceState]],
                meanwhile: Callable[[], None] | None = None) -> None:
        """Step `rows` and deliver their chunks; `meanwhile` runs while the step is on the device."""
        rows = [(s, u) for s, u in rows if s.spec.session_id in self._sessions and s.head is u]
        if not rows:
            if meanwhile is not None:
                meanwhile()
            return
        start, nonfinite = time.monotonic(), self.stats.nonfinite_fp32
        planned = [(s.spec.session_id, s.spec.voice_name, u.index == 0 and u.chunk_index == 0) for s, u in rows]
        for s, _ in rows:
            if s.first_audio_at is None:
                s.marks.step_start = start
        delivered: list[Chunk] = []

        def deliver(chunks: list[Chunk]) -> None:
            """One call's chunks, out now (the output stage flushes them to the sessions' loops)."""
            now = time.monotonic()
            # `meanwhile` may have failed some of the sessions that were stepped
            chunks = [c for c in chunks if c.session.spec.session_id in self._sessions]
            with stage("engine.deliver"):
                for c in chunks:
                    self.output.chunk(c.session, c.utterance, c.samples, c.precision, c.fallback, now, c.pcm16)
                self.output.flush()
            delivered.extend(chunks)

        try:
            with stage("engine.decode"):
                _, failed = self.executor.decode(rows, start, self._others_urgent, meanwhile, deliver,
                                                 between=self._tokens_meanwhile)
        except Exception as exc:  # outside any one step (slot bookkeeping): every row fails
            log.exception("decoder step failed")
            for s, _ in rows:
                if s.spec.session_id in self._sessions:
                    self._fail(s, exc)
            return
        now = time.monotonic()
        failed = [(s, why) for s, why in failed if s.spec.session_id in self._sessions]
        made = [(c.session.spec.session_id, c.session.spec.voice_name, c.fallback,
                 len(c.samples) / c.session.sample_rate) for c in delivered]
        self.telemetry.decoder_step(planned, made, start, now, time.monotonic(), self.stats.nonfinite_fp32 - nonfinite)
        for s, why in failed:
            self._fail(s, why)
        self.output.flush()

    def _others_urgent(self, s: SessionState) -> bool:
        """Another session is waiting for its first audio or will soon run out of it."""
        limit = self.batch.cpu_urgent_slack_s
        now = time.monotonic()
        return any(o is not s and o.utterances and o.slack(now) < limit for o in self._sessions.values())

    def _finish_if_done(self, s: SessionState) -> None:
        if self.output.finish_if_done(s):
            self._sessions.pop(s.spec.session_id, None)
            with self._cv:
                self._specs.pop(s.spec.session_id, None)

    def _fail(self, s: SessionState, exc: BaseException) -> None:
        self._sessions.pop(s.spec.session_id, None)
        with self._cv:
            self._specs.pop(s.spec.session_id, None)
        self.output.fail(s, exc)


@dataclass
class _Tracked(SessionState):
    """A session plus the ordering of its phonemised texts (the frontend may finish them
    out of order; they are applied in the order they were sent)."""

    # seq -> (handed to the frontend, phonemised, sentences)
    arrived: dict[int, tuple[float, float, list[PhonemizedSentence]]] = field(default_factory=dict)
    applied: int = 0
    end_after: int | None = None
    phonemes: int = 0  # phonemes of the texts applied so far
