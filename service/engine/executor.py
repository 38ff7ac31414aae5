"""The executor: runs what the scheduler planned on the backends.

* the acoustic stage for a batch of sentences (length-sorted, padded, masked);
* a decoder step: with slots, every planned session advances by the same number of decoder
  frames in one batched call (first chunks in their own call: they also fill the decoder's
  lag); the staged CPU decoder instead advances one session by its next chunk;
* the guard over the step's whole batch, and an FP32 redo of only the rows that tripped.

It returns decoded chunks; delivering them is the output stage's job."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from service.engine.cache import CachedUtterance
from service.engine.config import BatchConfig
from service.engine.shadow import ShadowVerifier
from service.engine.state import EngineStats, SessionState, UtteranceState, UtteranceStatus
from service.models.family import (
    AcousticJob,
    PendingAudio,
    StepRows,
    StreamingDecoder,
    VoiceRuntime,
    guard_host,
    utterance_rng,
)
from service.telemetry.ranges import stage
from service.telemetry.timeline import Timeline

log = logging.getLogger(__name__)
T = TypeVar("T")


Failure = tuple[SessionState, BaseException]


@dataclass
class Chunk:
    """One decoded chunk of one session's head utterance."""

    session: SessionState
    utterance: UtteranceState
    samples: np.ndarray
    precision: str
    fallback: bool
    pcm16: np.ndarray | None = None  # the same samples as int16 PCM, where the step's guard made them


@dataclass
class _InFlight:
    """A decoder step queued on the device: what `_finish` needs to cut its chunks."""

    rows: list[tuple[SessionState, UtteranceState]]
    precision: str
    frames: int
    fed: list[int]  # each row's frames fed before this step
    limits: list[int]  # each row's frames its decoder could make at launch (its input may be incomplete)
    pending: PendingAudio
    t0: float


class _Slots:
    """The decoder slots of one (voice, precision): a streaming decoder and its free list."""

    def __init__(self, decoder: StreamingDecoder, sample_rate: int) -> None:
        self.decoder = decoder
        self.sample_rate = sample_rate
        self.free = list(range(decoder.capacity - 1, -1, -1))

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def give(self, slot: int) -> None:
        self.free.append(slot)


class Executor:
    def __init__(
        self, config: BatchConfig, stats: EngineStats, shadow: ShadowVerifier | None = None,
        on_trip: Callable[[str], None] | None = None, timeline: Timeline | None = None,
    ) -> None:
        self.config = config
        self.timeline = timeline or Timeline()
        self.stats = stats
        self.shadow = shadow
        self.on_trip = on_trip
        self._slots: dict[tuple[int, str], _Slots] = {}
        # Audio seconds the engine thread makes per second of its work, measured while it was
        # busy (EngineCore.note_busy); 0 until then.
        self.engine_rate = 0.0
        self.staged_rate: float | None = None  # see freeze_rate
        self._rate_samples: list[float] = []

    # --- mode ------------------------------------------------------------------------------------

    def uses_slots(self, runtime: VoiceRuntime) -> bool:
        if self.config.decoder == "staged":
            return False
        has = runtime.capabilities.slot_decoder
        if self.config.decoder == "slots" and not has:
            raise ValueError(f"the {runtime.backend_name} backend has no slot decoder; use --decoder staged")
        return has

    def fill_rows(self, runtime: VoiceRuntime) -> int:
        """Rows a step that runs anyway is filled up to (`BatchConfig.step_fill_rows`): where a
        step runs on a device whose small batches cost about the same (CUDA), not where each
        row costs its own time (a CPU)."""
        return self.config.step_fill_rows if self.overlaps(runtime) else 0

    def max_rows(self, runtime: VoiceRuntime | None) -> int:
        """Sessions one step may advance: many with slots, one with the staged decoder."""
        return self.config.max_step_rows if runtime is None or self.uses_slots(runtime) else 1

    def slots(self, runtime: VoiceRuntime, precision: str) -> _Slots:
        key = (id(runtime), precision)
        pool = self._slots.get(key)
        if pool is None:
            first = runtime.schedule.first_frames
            decoder = runtime.streaming_decoder(
                precision, self.config.slots, max_rows=self.config.max_step_rows, graphs=self.config.cuda_graphs,
                graph_frames=(self.config.step_frames, first + runtime.streaming_lag()),
            )
            decoder.capture_all()
            if decoder.step_seconds:  # what a step costs by rows (step_fill_rows rests on it)
                log.info("%s decoder steps (rows, frames: ms): %s", precision, ", ".join(
                    f"{rows}x{n}: {seconds * 1e3:.2f}" for (rows, n), seconds in sorted(decoder.step_seconds.items())))
            pool = self._slots[key] = _Slots(decoder, runtime.sample_rate)
        return pool

    # Share of the measured throughput the capacity estimate promises (the frontend, the
    # acoustic stage and the event loops need the rest).
    CAPACITY_HEADROOM = 0.8
    # ... with staged decoding (a CPU): the warm-up measures the engine alone on idle cores,
    # while under load the frontend workers and the server's event loop take their share of the
    # same cores; bursts measured with `cadenza bench load` pass at about this share.
    STAGED_CAPACITY_HEADROOM = 0.4

    def capacity_streams(self, precision: str | None = None) -> float | None:
        """Real-time streams the engine can carry: audio seconds made per second at the best
        measured batch of steady steps (GPU step times timed at warm-up), or the staged
        decoder's measured speed with the acoustic stage, and never more than the whole engine
        thread made while it was busy (acoustic stage, planning and delivery included); times the
        headroom. None before anything was measured."""
        best = 0.0
        # Read from the core's figures thread while the engine thread may add pools and timings:
        # iterate over copies (list() of a dict view runs without giving up the GIL).
        for (_, p), pool in list(self._slots.items()):
            if precision is not None and p != precision:
                continue
            decoder, frames = pool.decoder, self.config.step_frames
            audio = frames * decoder.hop / pool.sample_rate  # seconds one row of one step makes
            for (rows, n), seconds in list(decoder.step_seconds.items()):
                if n == frames and seconds > 0:
                    best = max(best, rows * audio / seconds)
        headroom = self.CAPACITY_HEADROOM
        if not best and not self._slots:
            best = self.staged_rate if self.staged_rate is not None else self._warm_rate()
            headroom = self.STAGED_CAPACITY_HEADROOM
        if self.engine_rate > 0:
            best = min(best, self.engine_rate) if best else self.engine_rate
        return best * headroom if best else None

    def _staged_rate_now(self) -> float:
        """Staged decoding (a CPU): one thread runs every stage in turn, so a stream costs its
        acoustic stage as well as its decoding."""
        busy = self.stats.step_seconds + self.stats.acoustic_seconds
        return self.stats.audio_seconds / busy if self.stats.step_seconds > 0 else 0.0

    def sample_rate(self) -> None:
        """End one measured warm-up run (the core's `reset_rate`): keep its staged speed."""
        if not self._slots and (rate := self._staged_rate_now()):
            self._rate_samples.append(rate)

    def freeze_rate(self) -> None:
        """Keep the warm-up's staged speed as the capacity's basis. Its slowest measured run (the
        first, cold run not counted): on a CPU the engine's threads run fastest while the other
        cores are idle, which they are not under load (frontend workers, the API server), so a
        fast run overstates what the engine carries; and measured while serving, the figure would
        follow whatever else the host is doing, and admission with it."""
        if self.staged_rate is None and not self._slots:
            self.staged_rate = self._warm_rate() or None

    def _warm_rate(self) -> float:
        """The slowest of the measured warm-up runs and the run in progress."""
        now = self._staged_rate_now()
        runs = [*self._rate_samples[1:], *([now] if now else [])] or self._rate_samples
        return min(runs, default=0.0)

    def free_slots(self, session: SessionState, u: UtteranceState) -> int:
        """Slots free for `u`'s voice and precision (all of them before the first use)."""
        pool = self._slots.get((id(session.spec.runtime), u.precision))
        return self.config.slots if pool is None else len(pool.free)

    def release(self, session: SessionState, u: UtteranceState) -> None:
        """Give back the slot an utterance holds (done, failed or cancelled), and its place in
        an autoregressive family's token stage."""
        stage_of_tokens = session.spec.runtime.tokens
        if u.status is UtteranceStatus.TOKENS and stage_of_tokens is not None and u.decoder_input is not None:
            stage_of_tokens.release(u.decoder_input)
        self._free_slot(session, u)

    def _free_slot(self, session: SessionState, u: UtteranceState) -> None:
        """Give back the decoder slot only (a guard redo moves the utterance to an FP32 slot while
        it may still be making tokens)."""
        if u.slot is not None:
            pool = self.slots(session.spec.runtime, u.precision)
            pool.decoder.free(u.slot)
            pool.give(u.slot)
            u.slot = None

    # --- acoustic stage --------------------------------------------------------------------------

    def acoustic(
        self, jobs: list[tuple[SessionState, UtteranceState]], cache_key: Callable[[SessionState, UtteranceState],
                                                                                   Hashable | None],
        cache_get: Callable[[Hashable], CachedUtterance | None],
    ) -> list[tuple[SessionState, BaseException]]:
        """Run the acoustic stage for `jobs` (one voice); cached sentences skip it. Returns
        the sessions that failed, with why."""
        pending: list[tuple[SessionState, UtteranceState, AcousticJob]] = []
        for s, u in jobs:
            u.precision = s.spec.precision
            u.cache_key = cache_key(s, u)
            entry = cache_get(u.cache_key) if u.cache_key is not None else None
            if entry is not None:
                u.cached = entry
                u.word_spans = list(entry.word_spans)
                u.status = UtteranceStatus.CACHED
                continue
            spec = s.spec
            rng = s.rng if s.rng is not None else utterance_rng(spec.params.seed, u.sentence.phoneme_ids)
            pending.append((s, u, AcousticJob(u.sentence, spec.sid, spec.params, rng, spec.voice_prompt)))
        if not pending:
            return []
        runtime = pending[0][0].spec.runtime
        pending.sort(key=lambda p: len(p[2].sentence.phoneme_ids))  # length buckets: little padding
        failed: list[tuple[SessionState, BaseException]] = []
        for group in _groups(pending, self.config.acoustic_max_batch):
            try:
                with stage("acoustic.batch"):
                    utts = runtime.acoustic_batch([job for _, _, job in group])
            except Exception as exc:
                log.exception("acoustic stage failed")
                failed += [(s, exc) for s, _, _ in group]
                continue
            self.stats.acoustic_jobs += len(group)
            self.stats.acoustic_batches += 1
            for (s, u, _), utt in zip(group, utts, strict=True):
                u.decoder_input = utt
                u.word_spans = utt.word_spans
                if runtime.tokens is not None:
                    u.status = UtteranceStatus.TOKENS
                else:
                    self._decodable(s, u)
        return failed

    def _decodable(self, s: SessionState, u: UtteranceState) -> None:
        """`u`'s decoder input is complete: it is decoded from now on (staged: by a decoder of its own)."""
        assert u.decoder_input is not None
        u.status = UtteranceStatus.DECODING
        if not self.uses_slots(s.spec.runtime):
            u.bounds = s.spec.schedule.boundaries(u.frames, s.spec.schedule.first_chunk(u.index))
            u.staged = s.spec.runtime.utterance_decoder(u.decoder_input, s.spec.precision)

    # --- autoregressive steps --------------------------------------------------------------------

    def tokens(self, rows: list[tuple[SessionState, UtteranceState]]) -> list[Failure]:
        """One batched autoregressive step for `rows` (one voice); an utterance whose decoder
        input is complete goes on to decoding. Returns the sessions that failed, with why."""
        if not rows:
            return []
        stage_of_tokens = rows[0][0].spec.runtime.tokens
        assert stage_of_tokens is not None, "only an autoregressive family's utterances make tokens"
        try:
            with stage("tokens.step"), self.timeline.timed("tokens", rows=len(rows)):
                done = stage_of_tokens.step([u.decoder_input for _, u in rows])
        except Exception as exc:
            log.exception("autoregressive step of %d rows failed", len(rows))
            return [(s, exc) for s, _ in rows]
        failed: list[Failure] = []
        for (s, u), finished in zip(rows, done, strict=True):
            if isinstance(finished, Exception):
                failed.append((s, finished))
            elif finished:
                self._decodable(s, u)
        return failed

    # --- decoder steps ---------------------------------------------------------------------------

    def overlaps(self, runtime: VoiceRuntime) -> bool:
        """A decoder step runs on the device while the engine thread goes on (CUDA), so other
        work can be done between its launch and its result."""
        return self.uses_slots(runtime) and runtime.capabilities.asynchronous

    def decode(self, rows: list[tuple[SessionState, UtteranceState]], now: float,
               others_urgent: Callable[[SessionState], bool],
               meanwhile: Callable[[], None] | None = None,
               landed: Callable[[list[Chunk]], None] | None = None,
               between: Callable[[], bool] | None = None) -> tuple[list[Chunk], list[Failure]]:
        """Advance the planned rows: (chunks, sessions that failed with why). A failing batched
        step is retried in halves, each row's decoder state rebuilt first, so a fault that
        one row causes (or a batch too large for the device) fails only what it must.
        `meanwhile` runs once the first step is launched, before any result is waited for
        (after the chunk, where the decoder is synchronous). `landed` gets each call's chunks
        as soon as that call is cut, before the later calls are waited for: first chunks go
        out without waiting for the step that fills behind them. `between` runs again and
        again while a launched step is still on the device, until it says it has nothing to do
        (an autoregressive family's token steps, on their own stream, fill a long decoder step)."""
        once = _Once(meanwhile)
        try:
            return self._decode(rows, others_urgent, once, landed or (lambda chunks: None),
                                between or (lambda: False))
        finally:
            once()

    def _decode(self, rows: list[tuple[SessionState, UtteranceState]],
                others_urgent: Callable[[SessionState], bool], meanwhile: _Once,
                landed: Callable[[list[Chunk]], None],
                between: Callable[[], bool]) -> tuple[list[Chunk], list[Failure]]:
        if not rows:
            return [], []
        runtime = rows[0][0].spec.runtime
        if not self.uses_slots(runtime):
            s, u = rows[0]
            try:
                chunk = self._staged_chunk(s, u, others_urgent(s))
            except Exception as exc:
                log.exception("staged decode failed (session %d)", s.spec.session_id)
                return [], [(s, exc)]
            landed([chunk])
            return [chunk], []
        # One call per (voice, precision, first chunks or not), in the plan's order of urgency,
        # except that rows ranked after a precision's first chunks get their own call after them:
        # the rows that fill a step never hold up a session's first audio.
        groups: dict[tuple[int, str, bool, bool], list[tuple[SessionState, UtteranceState]]] = {}
        seen_first: set[tuple[int, str]] = set()
        failed: list[Failure] = []
        for s, u in rows:
            if u.slot is None:
                try:
                    if not self._start(s, u):
                        continue  # no slot or prior memory free: this utterance starts when one frees
                except Exception as exc:
                    failed.append((s, exc))
                    continue
            kind = (id(s.spec.runtime), u.precision)
            first = u.fed == 0
            if first:
                seen_first.add(kind)
            groups.setdefault((*kind, first, not first and kind in seen_first), []).append((s, u))
        if not groups:
            return [], failed
        batches = [(part, precision, first) for (_, precision, first, _), group in groups.items()
                   for part in _halves(group, self.PIPELINE_MIN_ROWS)]
        out: list[Chunk] = []
        # Pipelined: batch i+1 is prepared and launched while the device still runs batch i,
        # and batch i's chunks are built while the device runs batch i+1.
        flight = self._launch_or_fallback(*batches[0])
        for i in range(len(batches)):
            following = self._launch_or_fallback(*batches[i + 1]) if i + 1 < len(batches) else None
            meanwhile()
            while flight is not None and not flight.pending.ready() and between():
                pass
            chunks, bad = self._land(flight, *batches[i])
            landed(chunks)
            out += chunks
            failed += bad
            flight = following
        return out, failed

    def _start(self, s: SessionState, u: UtteranceState) -> bool:
        """Take a slot for `u` and start its prior there; False when none is free."""
        assert u.decoder_input is not None
        pool = self.slots(s.spec.runtime, u.precision)
        slot = pool.take()
        if slot is None:
            return False
        started = False
        try:
            started = pool.decoder.start(slot, u.decoder_input.prior)
        finally:
            if not started:
                pool.give(slot)
        if started:
            u.slot = slot
        return started

    # Batches of at least twice this many rows run as two halves, so the host's work on one
    # overlaps the device's work on the other.
    PIPELINE_MIN_ROWS = 32

    def _launch_or_fallback(self, rows: list[tuple[SessionState, UtteranceState]], precision: str,
                            first: bool) -> _InFlight | None:
        """Launch a step; None when the launch failed (`_land` then runs it synchronously,
        with its retry in halves)."""
        try:
            return self._launch(rows, precision, first)
        except Exception as exc:
            log.warning("decoder step launch of %d rows failed (%s)", len(rows), exc)
            return None

    def _land(self, flight: _InFlight | None, rows: list[tuple[SessionState, UtteranceState]], precision: str,
              first: bool) -> tuple[list[Chunk], list[Failure]]:
        if flight is not None:
            try:
                return self._finish(flight), []
            except Exception as exc:
                log.warning("decoder step of %d rows failed (%s); running it again", len(rows), exc)
        return self._slot_step(rows, precision, first)

    def _slot_step(self, rows: list[tuple[SessionState, UtteranceState]], precision: str,
                   first: bool) -> tuple[list[Chunk], list[Failure]]:
        try:
            out = self._finish(self._launch(rows, precision, first))
        except Exception as exc:
            if len(rows) == 1:
                log.exception("decoder step failed (session %d)", rows[0][0].spec.session_id)
                return [], [(rows[0][0], exc)]
            log.warning("decoder step of %d rows failed (%s); retrying in halves", len(rows), exc)
            failed: list[Failure] = []
            good = []
            for s, u in rows:
                try:
                    self._rebuild(s, u)
                    good.append((s, u))
                except Exception as rebuild_exc:
                    failed.append((s, rebuild_exc))
            half = (len(good) + 1) // 2
            out = []
            for part in (good[:half], good[half:]):
                if part:
                    chunks, bad = self._slot_step(part, precision, first)
                    out += chunks
                    failed += bad
            return out, failed
        return out, []

    def _rebuild(self, s: SessionState, u: UtteranceState) -> None:
        """Bring a slot's decoder state back to `u.fed` frames (a failed step may have updated
        some of its stages)."""
        assert u.slot is not None and u.decoder_input is not None
        if not self.slots(s.spec.runtime, u.precision).decoder.start(u.slot, u.decoder_input.prior):
            raise RuntimeError(f"no {u.precision} decoder prior memory free to decode this utterance again")
        self._replay(s, u)

    def _replay(self, s: SessionState, u: UtteranceState) -> Any:
        """Decode `u`'s prior frames up to `u.fed` in one step, in the slot it was just started
        in; returns that step's device audio (None when nothing was fed yet)."""
        assert u.slot is not None
        decoder = self.slots(s.spec.runtime, u.precision).decoder
        if not u.fed:
            return None
        sids = None if s.spec.sid is None else [s.spec.sid]
        return decoder.step(StepRows([u.slot], [0], u.fed, sids))

    def _launch(self, rows: list[tuple[SessionState, UtteranceState]], precision: str, first: bool) -> _InFlight:
        """Queue one batched step on the device (no waiting for it); advances each row's `fed`
        once it is queued (a launch that raises changes nothing)."""
        runtime = rows[0][0].spec.runtime
        decoder = self.slots(runtime, precision).decoder
        frames = (runtime.schedule.first_frames + decoder.lag) if first else self.config.step_frames
        utts = [u for _, u in rows]
        fed = [u.fed for u in utts]
        limits = [u.ready_frames(runtime.tokens) for u in utts]
        sids = None if rows[0][0].spec.sid is None else [s.spec.sid or 0 for s, _ in rows]
        slots = [u.slot for u in utts if u.slot is not None]
        assert len(slots) == len(utts), "every row of a step holds a slot"
        step = StepRows(slots, fed, frames, sids)
        t0 = time.perf_counter()
        with stage("step.launch"), self.timeline.timed("launch", rows=len(rows), first=first, frames=frames):
            pending = runtime.guard_async(decoder.step(step))
        for u, limit in zip(utts, limits, strict=True):
            u.fed = min(u.fed + frames, limit) if u.status is UtteranceStatus.TOKENS else u.fed + frames
        return _InFlight(rows, precision, frames, fed, limits, pending, t0)

    def _finish(self, flight: _InFlight) -> list[Chunk]:
        """Wait for a launched step and cut each row's chunk out of its audio (an FP32 redo for
        rows whose FP16 audio tripped the guard). If that fails, every row's `fed` goes back to
        where the step started, for the caller's retry."""
        try:
            return self._cut(flight)
        except BaseException:
            for (_, u), before in zip(flight.rows, flight.fed, strict=True):
                u.fed = before
            raise

    def _cut(self, flight: _InFlight) -> list[Chunk]:
        with stage("step.wait"), self.timeline.timed("landed", rows=len(flight.rows)):
            audio, nonfinite, pcm16 = flight.pending.result()
        rows, precision, frames = flight.rows, flight.precision, flight.frames
        runtime = rows[0][0].spec.runtime
        decoder = self.slots(runtime, precision).decoder
        self.stats.step_seconds += time.perf_counter() - flight.t0
        self.stats.steps += 1
        self.stats.rows += len(rows)
        self.stats.max_rows = max(self.stats.max_rows, len(rows))
        out = []
        hop = decoder.hop
        for i, (s, u) in enumerate(rows):
            start = (flight.fed[i] - decoder.lag) * hop  # position of audio[i, 0] in the utterance
            lo = max(0, start)
            hi = max(lo, min(flight.limits[i] * hop, start + frames * hop))  # lo == hi: none of it is this utterance's
            fallback = False
            if nonfinite[i] and precision != "fp32":
                samples, pcm = self._redo_fp32(s, u, lo, hi)
                fallback = True
            else:
                if nonfinite[i]:
                    self.stats.nonfinite_fp32 += 1  # zeroed by the guard: no FP32 to fall back to
                samples = audio[i, lo - start : hi - start]
                pcm = None if pcm16 is None else pcm16[i, lo - start : hi - start]
                if (self.shadow is not None and precision != "fp32" and hi > lo and u.decoder_input is not None
                        and u.status is not UtteranceStatus.TOKENS):  # the reference needs every token
                    self.shadow.offer(runtime, u.decoder_input, (lo, hi), samples)
            self.stats.audio_seconds += (hi - lo) / runtime.sample_rate
            out.append(Chunk(s, u, samples, u.precision if not fallback else "fp32", fallback, pcm))
        return out

    def _redo_fp32(self, s: SessionState, u: UtteranceState, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Guard tripped: decode this utterance again in FP32 up to where the FP16 step got
        (same prior sample), keep this chunk's span (audio and PCM), and continue the utterance
        in FP32."""
        runtime = s.spec.runtime
        self._free_slot(s, u)
        u.precision = "fp32"
        if not self._start(s, u):  # the session fails with this; the others go on
            raise RuntimeError("no FP32 decoder slot or prior memory free for a guard redo")
        pool = self.slots(runtime, "fp32")
        audio, _, pcm16 = runtime.guard_async(self._replay(s, u)).result()
        start = -pool.decoder.lag * pool.decoder.hop
        self.stats.fallbacks += 1
        log.warning("guard tripped (session %d): chunk recomputed in fp32", s.spec.session_id)
        if self.on_trip is not None:
            self.on_trip(s.spec.voice_name)
        return audio[0, lo - start : hi - start], None if pcm16 is None else pcm16[0, lo - start : hi - start]

    def _staged_chunk(self, s: SessionState, u: UtteranceState, others_urgent: bool) -> Chunk:
        """The next chunk of one utterance from its staged decoder (CPU; FP32 or INT8)."""
        assert u.staged is not None
        hop = s.spec.runtime.hop
        k = u.chunk_index
        schedule = s.spec.schedule
        if k == 0 and u.index == 0 and not others_urgent and schedule.staged_first_frames < u.bounds[1]:
            u.bounds = schedule.staged_boundaries(u.frames)  # alone: a shorter first chunk
        a, b = u.bounds[k], u.bounds[k + 1]
        quantum = self.config.cpu_quantum_frames
        if 0 < quantum < b - a and others_urgent:
            b = a + quantum
            u.bounds.insert(k + 1, b)  # the rest of the planned chunk comes next
        t0 = time.perf_counter()
        with self.timeline.timed("chunk", rows=1, frames=b - a):
            guarded = guard_host(u.staged.audio(a * hop, b * hop)[None])
        samples = guarded.audio[0]
        self.stats.nonfinite_fp32 += int(guarded.nonfinite[0] > 0)  # zeroed: no staged redo
        self.stats.step_seconds += time.perf_counter() - t0
        self.stats.steps += 1
        self.stats.rows += 1
        self.stats.max_rows = max(self.stats.max_rows, 1)
        self.stats.audio_seconds += len(samples) / s.spec.runtime.sample_rate
        return Chunk(s, u, samples, u.staged.precision, False)


class _Once:
    """Calls `fn` the first time it is called, then nothing."""

    def __init__(self, fn: Callable[[], None] | None) -> None:
        self._fn = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


def _halves(items: list[T], min_rows: int) -> list[list[T]]:
    """`items` as two halves when each has at least `min_rows`, else whole."""
    if len(items) < 2 * min_rows:
        return [items]
    half = (len(items) + 1) // 2
    return [items[:half], items[half:]]


def _groups(items: list[T], size: int) -> list[list[T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]
