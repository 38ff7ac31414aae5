"""The engine's instrumentation interface: what the session, the engine thread and the
admission code report, turned into OpenTelemetry metrics and spans here (and only here:
nothing outside `service.telemetry` imports opentelemetry).

Recording is per session, per utterance and per engine step, never per sample; the hot path
(an engine step) makes at most a few instrument calls. Without providers (the default) every
instrument is OpenTelemetry's no-op, so an unobserved server pays almost nothing."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, MeterProvider, NoOpMeterProvider, Observation
from opentelemetry.trace import Link, NoOpTracerProvider, SpanKind, Status, StatusCode, TracerProvider

log = logging.getLogger("service.sessions")

SECONDS_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
PSNR_BUCKETS_DB = (20.0, 30.0, 40.0, 45.0, 50.0, 55.0, 60.0, 70.0, 80.0, 100.0)

STAGE_DECODER = "decoder"  # the stage the guard checks (every decoded chunk)
PRECISIONS = ("fp16", "fp32", "int8")  # what a session's precision resolves to
REJECT_REASONS = ("capacity", "max_sessions", "draining", "not_ready", "engine_failed")


def _version() -> str:
    try:
        return metadata.version("cadenza")
    except metadata.PackageNotFoundError:  # a source tree without an install
        return "0"


@dataclass(frozen=True)
class SessionInfo:
    """What a session resolved to at open: its span's attributes and its metrics' labels."""

    session_id: int
    voice: str
    precision: str
    precision_reason: str
    encoding: str
    sample_rate: int
    request_id: str = ""


@dataclass
class SessionTrace:
    """One session's span and per-session figures. Created and ended on the session's event
    loop; the engine thread only adds events and children to its span."""

    info: SessionInfo
    span: trace.Span
    opened_at: float  # time.monotonic()
    play_start: float | None = None  # playback clock: when the client's audio would have started
    audio_s: float = 0.0  # audio delivered so far
    last_chunk_at: float | None = None
    max_gap_s: float = 0.0
    underruns: int = 0
    underrun_s: float = 0.0
    ttfa_s: float | None = None
    ended: bool = False

    def chunk(self, now: float, seconds: float) -> None:
        """A chunk of `seconds` of audio reached the client's queue at `now`: track gaps and
        underruns against a client that plays from the first chunk (arithmetic only)."""
        if self.play_start is None:
            self.play_start = now
        else:
            gap = now - (self.last_chunk_at or now)
            self.max_gap_s = max(self.max_gap_s, gap)
            late = now - (self.play_start + self.audio_s)
            if late > 0:  # the client's buffer ran dry `late` seconds ago; playback resumes now
                self.underruns += 1
                self.underrun_s += late
                self.play_start += late
        self.last_chunk_at = now
        self.audio_s += seconds


@dataclass
class _Rows:
    """Per-voice tallies of one engine step, grouped before recording (few instrument calls)."""

    fallbacks: int = 0
    audio_s: float = 0.0


@dataclass
class Telemetry:
    """Metrics and traces for one server (or one LocalEngine). Thread-safe: instruments are
    called from the event loop and the engine thread.

    `status_of` names an exception's status for the session-end line (the gRPC layer gives its
    mapping; without it the exception's class name). `log_text`: the caller's text may appear
    in logs (off by default: it can be personal data)."""

    meter_provider: MeterProvider | None = None
    tracer_provider: TracerProvider | None = None
    status_of: Callable[[BaseException], str] | None = None
    log_text: bool = False
    step_span_links: int = 32
    closers: list[Callable[[], None]] = field(default_factory=list)  # run at shutdown (endpoints)
    metrics_port: int | None = None  # the Prometheus endpoint's port, once listening
    metrics_also: list[str] | None = None  # other processes' endpoints it adds up (MetricsEndpoint)
    _traces: dict[int, SessionTrace] = field(default_factory=dict, init=False, repr=False)
    _queued: dict[tuple[int, int], float] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.tracing = self.tracer_provider is not None
        meter = (self.meter_provider or NoOpMeterProvider()).get_meter("cadenza", _version())
        self.tracer = (self.tracer_provider or NoOpTracerProvider()).get_tracer("cadenza", _version())

        def hist(name: str, unit: str, description: str, buckets: Sequence[float]) -> Any:
            return meter.create_histogram(name, unit=unit, description=description,
                                          explicit_bucket_boundaries_advisory=list(buckets))

        self.ttfa = hist("cadenza.session.time_to_first_audio", "s",
                         "First text received -> first audio ready for the client, once per session",
                         SECONDS_BUCKETS)
        self.first_audio_stage = hist(
            "cadenza.session.first_audio.stage", "s",
            "Time a session's first sentence spent in each stage before its first audio (stage: frontend, "
            "acoustic_wait, acoustic, decoder_wait, decoder)", SECONDS_BUCKETS)
        self.session_duration = hist("cadenza.session.duration", "s", "Session open -> end", SECONDS_BUCKETS)
        self.chunk_gap = hist("cadenza.session.chunk_gap.max", "s",
                              "Largest gap between two consecutive audio chunks of a session", SECONDS_BUCKETS)
        self.underruns = meter.create_counter(
            "cadenza.session.underruns", unit="{underrun}",
            description="Times a client playing from its first chunk would have run out of audio")
        self.underrun_time = hist("cadenza.session.underrun.duration", "s",
                                  "Silence a client playing from its first chunk would have heard, per session",
                                  SECONDS_BUCKETS)
        self.audio = meter.create_counter("cadenza.audio.duration", unit="s",
                                          description="Audio delivered to clients")
        self.active = meter.create_up_down_counter("cadenza.sessions.active", unit="{session}",
                                                   description="Sessions open now")
        self.admitted = meter.create_counter("cadenza.sessions.admitted", unit="{session}",
                                             description="Sessions admitted")
        self.rejected = meter.create_counter("cadenza.sessions.rejected", unit="{session}",
                                             description="Sessions refused (reason: capacity, max_sessions, "
                                                         "draining, not_ready, engine_failed)")
        self.admission_wait = hist("cadenza.admission.wait", "s",
                                   "Time a new session waited for room before it was admitted or refused",
                                   SECONDS_BUCKETS)
        self.queue_wait = hist("cadenza.utterance.queue_wait", "s",
                               "A sentence's arrival at the engine (phonemised) -> its acoustic stage start",
                               SECONDS_BUCKETS)
        self.step_time = hist("cadenza.engine.step.duration", "s",
                              "Wall time of one engine step (stage: acoustic or decoder)", STEP_BUCKETS)
        self.batch_size = hist("cadenza.engine.batch.size", "{row}",
                               "Sessions (decoder) or sentences (acoustic) served by one engine step", BATCH_BUCKETS)
        self.chunk_latency = hist("cadenza.chunk.compute_latency", "s",
                                  "Decoder step start -> its chunks handed to their sessions (guard and FP32 "
                                  "redo included)", STEP_BUCKETS)
        self.rtf = hist("cadenza.engine.real_time_factor", "1",
                        "Decoder step compute time / audio it made (below 1: faster than real time)", RTF_BUCKETS)
        self.compute = meter.create_counter("cadenza.engine.compute.duration", unit="s",
                                            description="Engine time in decoder steps (rate / audio rate = RTF)")
        self.trips = meter.create_counter("cadenza.guard.trips", unit="{chunk}",
                                          description="Chunks in which the guard found NaN/Inf")
        self.fallbacks = meter.create_counter("cadenza.guard.fp32_fallbacks", unit="{chunk}",
                                              description="Chunks recomputed in FP32 after a guard trip")
        self.psnr = hist("cadenza.shadow.psnr", "dB",
                         "FP16 chunk vs its FP32 recomputation (shadow verification), waveform PSNR",
                         PSNR_BUCKETS_DB)
        self.meter = meter
        # Counters of events are on /metrics at 0 from the start, not from their first event
        # (a dashboard would show "no data" where there were none). Per voice: `voice_loaded`.
        self.admitted.add(0)
        for reason in REJECT_REASONS:
            self.rejected.add(0, {"reason": reason})

    def voice_loaded(self, voice: str) -> None:
        """Put the voice's series of event counters (and of open sessions) at 0."""
        self.active.add(0, {"cadenza.voice": voice})
        self.fallbacks.add(0, {"cadenza.voice": voice, "stage": STAGE_DECODER})
        for precision in PRECISIONS:
            labels = {"cadenza.voice": voice, "cadenza.precision": precision}
            self.trips.add(0, {**labels, "stage": STAGE_DECODER})
            self.underruns.add(0, labels)

    # --- set-up ----------------------------------------------------------------------------------

    def observe(self, cache: Callable[[], tuple[int, int]] | None = None,
                gpu_memory: Callable[[], Mapping[str, int]] | None = None) -> None:
        """Register pulled figures (read at collection time, never on the hot path):
        `cache` -> (hits, misses); `gpu_memory` -> bytes allocated per device."""
        if cache is not None:
            def cache_cb(options: CallbackOptions) -> Iterable[Observation]:
                hits, misses = cache()
                return [Observation(hits, {"cadenza.cache.result": "hit"}),
                        Observation(misses, {"cadenza.cache.result": "miss"})]

            self.meter.create_observable_counter(
                "cadenza.cache.lookups", [cache_cb], unit="{lookup}",
                description="Result cache lookups of seeded sentences (result: hit or miss)")
        if gpu_memory is not None:
            def gpu_cb(options: CallbackOptions) -> Iterable[Observation]:
                return [Observation(used, {"hw.id": device}) for device, used in gpu_memory().items()]

            self.meter.create_observable_up_down_counter(
                "hw.gpu.memory.usage", [gpu_cb], unit="By",
                description="GPU memory allocated by the engine (tensors, decoder slots, graphs)")

    def shutdown(self) -> None:
        """Flush and stop the exporters (the server calls it once, at stop)."""
        for close in self.closers:
            close()
        self.closers.clear()
        for provider in (self.meter_provider, self.tracer_provider):
            stop = getattr(provider, "shutdown", None)
            if stop is not None:
                try:
                    stop()
                except Exception:  # an exporter that cannot flush must not fail the shutdown
                    logging.getLogger(__name__).warning("telemetry exporter failed to shut down", exc_info=True)

    @staticmethod
    def _ns(monotonic_s: float) -> int:
        """A monotonic time as wall-clock nanoseconds (what span times are), by its distance
        from now: spans started without a time read the wall clock then, and an offset taken
        once drifts from it while NTP slews the wall clock."""
        return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)

    # --- admission (event loop) ------------------------------------------------------------------

    def admission(self, admitted: bool, waited_s: float, reason: str = "") -> None:
        if admitted:
            self.admitted.add(1)
        else:
            self.rejected.add(1, {"reason": reason})
        if waited_s > 0 or not admitted:
            self.admission_wait.record(waited_s, {"result": "admitted" if admitted else "rejected"})

    # --- sessions (event loop) -------------------------------------------------------------------

    def session_opened(self, info: SessionInfo) -> SessionTrace:
        """Start the session's span (a child of the RPC's span when there is one)."""
        attributes: dict[str, Any] = {
            "cadenza.session.id": info.session_id, "cadenza.voice": info.voice,
            "cadenza.precision": info.precision, "cadenza.precision.reason": info.precision_reason,
            "cadenza.audio.encoding": info.encoding, "cadenza.audio.sample_rate": info.sample_rate,
        }
        if info.request_id:
            attributes["cadenza.request_id"] = info.request_id
        span = self.tracer.start_span("cadenza.session", kind=SpanKind.INTERNAL, attributes=attributes)
        record = SessionTrace(info, span, time.monotonic())
        self._traces[info.session_id] = record
        self.active.add(1, {"cadenza.voice": info.voice})
        return record

    def first_audio(self, record: SessionTrace, ttfa_s: float) -> None:
        """Called once per session, when its first audio is ready."""
        record.ttfa_s = ttfa_s
        self.ttfa.record(ttfa_s, {"cadenza.voice": record.info.voice, "cadenza.precision": record.info.precision})
        record.span.add_event("first_audio", {"cadenza.ttfa_s": ttfa_s})

    def session_ended(self, record: SessionTrace, error: BaseException | None, cancelled: bool,
                      characters: int, fallbacks: int, unread_s: float = 0.0) -> None:
        """End the span, record the per-session figures and log the one session-end line.
        `unread_s`: of the audio made for the session, what its client's transport never took
        (logged apart from what was sent)."""
        if record.ended:
            return
        record.ended = True
        self._traces.pop(record.info.session_id, None)
        info = record.info
        if error is not None:
            status = self.status_of(error) if self.status_of is not None else type(error).__name__
            outcome = "error"
        elif cancelled:
            status, outcome = "CANCELLED", "cancelled"
        else:
            status, outcome = "OK", "ok"
        now = time.monotonic()
        labels = {"cadenza.voice": info.voice, "cadenza.precision": info.precision}
        self.active.add(-1, {"cadenza.voice": info.voice})
        self.session_duration.record(now - record.opened_at, {**labels, "outcome": outcome})
        if record.audio_s:
            self.audio.add(record.audio_s, labels)
            self.chunk_gap.record(record.max_gap_s, labels)
            self.underrun_time.record(record.underrun_s, labels)
        if record.underruns:
            self.underruns.add(record.underruns, labels)
        sent = max(0.0, record.audio_s - unread_s)  # taken by the client's transport
        span = record.span
        span.set_attributes({"cadenza.audio_s": sent, "cadenza.unread_s": unread_s, "cadenza.characters": characters,
                             "cadenza.fallbacks": fallbacks, "cadenza.outcome": outcome,
                             "cadenza.status": status})
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, status))
        span.end()
        ids = _ids(span)
        log.info(
            "session end: request_id=%s voice=%s precision=%s ttfa_ms=%s audio_s=%.2f unread_s=%.2f characters=%d "
            "fallbacks=%d underruns=%d outcome=%s status=%s",
            info.request_id or "-", info.voice, info.precision,
            f"{record.ttfa_s * 1000:.1f}" if record.ttfa_s is not None else "-", sent, unread_s, characters,
            fallbacks, record.underruns, outcome, status,
            extra={"request_id": info.request_id, "voice": info.voice, "precision": info.precision,
                   "ttfa_s": record.ttfa_s, "audio_s": round(sent, 3), "unread_s": round(unread_s, 3),
                   "outcome": outcome,
                   "status": status, **ids},
        )

    # --- engine thread ---------------------------------------------------------------------------

    def utterance_queued(self, session_id: int, index: int, now: float) -> None:
        """A sentence of a session reached the engine (phonemised)."""
        self._queued[(session_id, index)] = now

    def first_audio_stages(self, stages: Mapping[str, float]) -> None:
        """Where one session's time to first audio went (seconds per stage)."""
        for stage, seconds in stages.items():
            self.first_audio_stage.record(seconds, {"stage": stage})

    def acoustic_step(self, jobs: Sequence[tuple[int, int]], start: float, end: float) -> None:
        """One acoustic-stage call for `jobs` ((session id, utterance index)) ran from `start`."""
        attrs = {"stage": "acoustic"}
        self.step_time.record(end - start, attrs)
        self.batch_size.record(len(jobs), attrs)
        queued = self._queued
        for key in jobs:
            arrived = queued.get(key)
            if arrived is not None and arrived <= start:
                self.queue_wait.record(start - arrived)
        if self.tracing and any(index == 0 for _, index in jobs):  # calls with a session's first sentence
            self._step_span("cadenza.engine.acoustic", [sid for sid, _ in jobs], start, end,
                            {"cadenza.batch.size": len(jobs)})

    def decoder_step(self, rows: Sequence[tuple[int, str, bool]], chunks: Sequence[tuple[int, str, bool, float]],
                     start: float, computed: float, delivered: float, fp32_nonfinite: int) -> None:
        """One decoder step. `rows`: (session id, voice, the session's first chunk) planned;
        `chunks`: (session id, voice, FP32 fallback, audio seconds) made; times in monotonic
        seconds (start, executor done, chunks delivered); `fp32_nonfinite`: FP32 rows the guard
        zeroed (no fallback possible)."""
        if not rows:
            return
        attrs = {"stage": STAGE_DECODER}
        compute = computed - start
        self.step_time.record(compute, attrs)
        self.batch_size.record(len(rows), attrs)
        self.chunk_latency.record(delivered - start)
        self.compute.add(compute)
        per_voice: dict[str, _Rows] = {}
        for sid, voice, fallback, seconds in chunks:
            tally = per_voice.get(voice)
            if tally is None:
                tally = per_voice[voice] = _Rows()
            tally.audio_s += seconds
            if fallback:
                tally.fallbacks += 1
                self._fallback_event(sid)
        audio = sum(t.audio_s for t in per_voice.values())
        if audio > 0:
            self.rtf.record(compute / audio)
        for voice, tally in per_voice.items():
            if tally.fallbacks:
                labels = {"cadenza.voice": voice, "stage": STAGE_DECODER}
                self.trips.add(tally.fallbacks, {**labels, "cadenza.precision": "fp16"})
                self.fallbacks.add(tally.fallbacks, labels)
        if fp32_nonfinite:
            self.trips.add(fp32_nonfinite, {"cadenza.voice": rows[0][1], "stage": STAGE_DECODER,
                                            "cadenza.precision": "fp32"})
        if self.tracing and any(first for _, _, first in rows):  # steps that make a session's first audio
            self._step_span("cadenza.engine.step", [sid for sid, _, _ in rows], start, computed,
                            {"cadenza.batch.size": len(rows)})

    def _fallback_event(self, session_id: int) -> None:
        record = self._traces.get(session_id)
        if record is not None:
            record.span.add_event("guard_trip", {"stage": STAGE_DECODER})
            record.span.add_event("fp32_fallback", {"stage": STAGE_DECODER})

    def _step_span(self, name: str, session_ids: Sequence[int], start: float, end: float,
                   attributes: dict[str, Any]) -> None:
        """A span for one engine step, linked to (up to `step_span_links` of) the sessions it served."""
        links = []
        for sid in dict.fromkeys(session_ids):
            record = self._traces.get(sid)
            if record is not None:
                links.append(Link(record.span.get_span_context()))
                if len(links) >= self.step_span_links:
                    break
        if not links:  # only the server's own warm-up sessions
            return
        span = self.tracer.start_span(name, context=trace.set_span_in_context(trace.INVALID_SPAN), links=links,
                                      attributes=attributes, start_time=self._ns(start))
        span.end(end_time=self._ns(end))

    def utterance_done(self, session_id: int, index: int, chunks: int, frames: int, characters: int,
                       precision: str, cached: bool, now: float) -> None:
        """An utterance delivered its last chunk: a child span of its session, from its arrival."""
        arrived = self._queued.pop((session_id, index), None)
        if not self.tracing:
            return
        record = self._traces.get(session_id)
        if record is None:
            return
        span = self.tracer.start_span(
            "cadenza.utterance", context=trace.set_span_in_context(record.span),
            start_time=self._ns(arrived if arrived is not None else now),
            attributes={"cadenza.utterance.index": index, "cadenza.utterance.chunks": chunks,
                        "cadenza.utterance.frames": frames, "cadenza.utterance.characters": characters,
                        "cadenza.precision": precision, "cadenza.cached": cached},
        )
        span.end(end_time=self._ns(now))

    def utterance_dropped(self, session_id: int, index: int) -> None:
        self._queued.pop((session_id, index), None)

    def shadow_psnr(self, psnr_db: float, voice: str) -> None:
        """Shadow verification measured one FP16 chunk against FP32."""
        self.psnr.record(psnr_db, {"cadenza.voice": voice})


def _ids(span: trace.Span) -> dict[str, str]:
    """The span's trace and span ids as log fields (none for a non-recording span)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}


__all__ = ["PRECISIONS", "PSNR_BUCKETS_DB", "REJECT_REASONS", "SessionInfo", "SessionTrace", "Telemetry"]
