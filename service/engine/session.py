"""Loop-side half of a session: segmenter, audio output and the event queue.

Everything here runs on the asyncio event loop that opened the session; the engine thread
only reaches it through call_soon_threadsafe, so no state needs a lock."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from service.audio.output import AudioOutput
from service.engine.contract import (
    AudioOut,
    FailedPrecondition,
    Precision,
    ResourceExhausted,
    SessionConfig,
    SessionEvent,
    SessionSummary,
    WordTiming,
    check_text,
)
from service.engine.host import Host
from service.engine.state import ChunkResult, ReadCursor
from service.telemetry import SessionInfo, Telemetry
from service.telemetry.timeline import Timeline
from service.text.segment import IncrementalSegmenter, SegmenterConfig

_END = object()
_WAKE = object()  # wakes events() to look at an interrupt


@dataclass(frozen=True)
class SessionSetup:
    """What the engine resolved for a session before it starts."""

    session_id: int
    config: SessionConfig
    in_rate: int
    out_rate: int
    precision: Precision
    segmenter: SegmenterConfig
    pieces: bool  # the voice decodes whole utterances: its stream is cut in growing pieces
    max_text_chars: int
    max_audio_bytes: int = 1 << 20  # larger chunks are split (they must fit one gRPC message)
    precision_reason: str = ""
    cursor: ReadCursor = field(default_factory=ReadCursor)  # what the client took (shared with the engine)
    max_ahead_s: float = 3.0  # the engine holds the session back while this much audio is unread


class _EventQueue:
    """The session's events in order, waiting for its consumer (the RPC writing to the client).

    Audio that arrives while the previous audio event is still waiting is appended to it (same
    utterance, precision and fallback flag, no word timings, within `max_bytes`): when the
    writer falls behind (a server loop busy with many streams) a session's chunks go out as
    fewer, larger messages, each of which costs the loop about the same whatever its size. A
    writer that keeps up sees every chunk as it came, so first audio is never held back."""

    def __init__(self, max_bytes: int) -> None:
        self._items: deque[object] = deque()
        self._tail: list[AudioOut] = []  # audio appended to the last item (an AudioOut), joined when taken
        self._tail_bytes = 0
        self._waiter: asyncio.Future[None] | None = None
        self._max_bytes = max_bytes
        self.merged = 0  # audio events appended to the one before them

    def empty(self) -> bool:
        return not self._items

    def put(self, item: object) -> None:
        self._seal()
        self._items.append(item)
        self._tail_bytes = len(item.audio) if isinstance(item, AudioOut) else 0
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def put_audio(self, event: AudioOut) -> bool:
        """Queue `event`, or append it to the audio event still waiting before it; True if it
        was appended (it then takes no sequence number of its own)."""
        last = self._items[-1] if self._items else None
        end = self._tail[-1] if self._tail else last  # the audio it would follow
        if (isinstance(last, AudioOut) and isinstance(end, AudioOut) and not event.words
                and last.utterance == event.utterance and last.precision is event.precision
                and last.fallback == event.fallback
                and end.offset_samples + end.num_samples == event.offset_samples
                and self._tail_bytes + len(event.audio) <= self._max_bytes):
            self._tail.append(event)
            self._tail_bytes += len(event.audio)
            self.merged += 1
            return True
        self.put(event)
        return False

    async def get(self) -> object:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if len(self._items) == 1:
            self._seal()
            self._tail_bytes = 0
        return self._items.popleft()

    def _seal(self) -> None:
        """Join the audio appended to the last item into it."""
        if self._tail:
            last = self._items[-1]
            assert isinstance(last, AudioOut)
            parts = [last, *self._tail]
            self._items[-1] = dataclasses.replace(last, audio=b"".join(p.audio for p in parts),
                                                  num_samples=sum(p.num_samples for p in parts))
            self._tail = []


class EngineSession:
    """One stream. Implements `service.engine.contract.Session`. With `telemetry` it has a span and
    its figures are recorded (the server's own warm-up sessions have none)."""

    def __init__(self, setup: SessionSetup, loop: Host, on_close: Callable[[EngineSession], None],
                 telemetry: Telemetry | None = None, voice: str = "", timeline: Timeline | None = None) -> None:
        self.setup = setup
        self._timeline = timeline or Timeline()  # the server's side: first text in, first audio out
        self.id = setup.session_id
        self._engine_loop = loop
        self._on_close = on_close
        self._aloop = asyncio.get_running_loop()
        self._queue = _EventQueue(setup.max_audio_bytes)
        self._interrupt: BaseException | None = None  # see interrupt()
        self._segmenter = IncrementalSegmenter(setup.segmenter, pieces=setup.pieces)
        cfg = setup.config
        self._output = AudioOutput(setup.in_rate, setup.out_rate, cfg.encoding, cfg.wav_header)
        self._state = "open"  # open -> ending (end_input) -> closed
        self._chars = 0
        self._seq = 0
        self._model_offset = 0  # model-rate samples received so far
        self._utterances: set[int] = set()
        self._fallbacks = 0
        self._cache_hits = 0
        self._first_text_at: float | None = None
        self._first_audio_at: float | None = None
        self._last_text_at = 0.0  # when text last went to the engine
        self._ttfa: float | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._last_out = time.monotonic()  # when the client last took an event (or text was sent)
        self._writing = False  # an event is out with the consumer (being written to the client)
        self._telemetry = telemetry
        self._trace = telemetry.session_opened(SessionInfo(
            setup.session_id, voice, setup.precision.value, setup.precision_reason, cfg.encoding.name,
            setup.out_rate, cfg.request_id)) if telemetry is not None else None

    @property
    def accepts_pcm16(self) -> bool:
        """Its chunks may come as int16 PCM (see AudioOutput)."""
        return self._output.accepts_pcm16

    @property
    def closed(self) -> bool:
        return self._state == "closed"

    # --- client side -------------------------------------------------------------------------

    def push_text(self, delta: str) -> None:
        self._check_open("push text")
        check_text(delta)
        if self._chars + len(delta) > self.setup.max_text_chars:
            raise ResourceExhausted(
                f"session text limit is {self.setup.max_text_chars} characters; open a new session for more"
            )
        self._chars += len(delta)
        now = time.monotonic()
        if self._first_text_at is None and delta:
            self._first_text_at = now
            self._timeline.add("text_in", sid=self.id, rid=self.setup.config.request_id)
        self._submit(self._segmenter.push(delta, now))
        self._arm_idle()

    def flush(self) -> None:
        self._check_open("flush")
        self._submit(self._segmenter.flush())

    def end_input(self) -> None:
        self._check_open("end input")
        self._submit(self._segmenter.flush())
        self._state = "ending"
        self._disarm_idle()
        self._engine_loop.submit_end(self.id)

    def cancel(self, error: BaseException | None = None) -> None:
        ended_by = error if isinstance(error, Exception) else None  # not CancelledError: the client left
        if self._state == "closed":  # finished: the client left before taking all of it, or took it
            self._report(ended_by, cancelled=ended_by is None)
            return
        self._close(error=ended_by, cancelled=ended_by is None)
        self._engine_loop.submit_cancel(self.id)
        self._queue.put(_END)

    def interrupt(self, error: BaseException) -> None:
        self._interrupt = error
        self._queue.put(_WAKE)

    async def events(self) -> AsyncIterator[SessionEvent]:
        while True:
            if self._interrupt is not None:
                raise self._interrupt
            item = await self._queue.get()
            if item is _WAKE:
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, AudioOut | SessionSummary)
            self._writing = True
            try:
                yield item
            finally:
                self._writing = False
                self._last_out = time.monotonic()
            if isinstance(item, SessionSummary):
                self._report(None, cancelled=False)
                return
            self._taken(item)

    # Seconds after its last text reached the engine, or after its audio played out, that a
    # session still counts as needing the engine (its next sentence is likely on its way).
    DEMAND_LINGER_S = 2.0

    # A session this far ahead of its playback clock reads faster than real time (a batch
    # client), or its client stopped reading and its transport is still taking audio: it is
    # served when nothing is urgent, and is no real-time stream for admission to count.
    DEMAND_AHEAD_S = 10.0

    def demanding(self, now: float) -> bool:
        """Needs the engine now or soon (what admission counts): it has had no audio yet, holds
        text not yet released, is speaking (on the playback clock from its first audio, less than
        `DEMAND_AHEAD_S` ahead of it), or sent text lately. A session waiting for its next text
        asks nothing."""
        if self._state == "closed":
            return False
        if self._first_audio_at is None or self._segmenter.pending:
            return True
        playing_until = self._first_audio_at + self.setup.cursor.delivered_s
        if playing_until - now >= self.DEMAND_AHEAD_S:
            return False
        return now < max(playing_until, self._last_text_at) + self.DEMAND_LINGER_S

    def quiet_s(self, now: float) -> float:
        if self._writing or not self._queue.empty():
            return 0.0
        return max(0.0, now - self._last_out)

    def _taken(self, event: AudioOut) -> None:
        """Advance the read cursor; wake the engine when the client gets back under the limit."""
        cursor, limit = self.setup.cursor, self.setup.max_ahead_s
        before = cursor.delivered_s - cursor.read_s
        cursor.read_s += event.num_samples / event.sample_rate
        held = before >= limit / 2 and cursor.delivered_s - cursor.read_s < limit  # may have been held back
        self._engine_loop.taken(self.id, cursor.read_s, held)

    # --- helpers -----------------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._state != "open":
            raise FailedPrecondition(f"cannot {what}: the session's input has ended or it was cancelled")

    def _submit(self, texts: list[str]) -> None:
        for text in texts:
            if text.strip():
                self._engine_loop.submit_text(self.id, text)
                self._last_out = self._last_text_at = time.monotonic()  # audio for it is on its way

    def _arm_idle(self) -> None:
        """Poll the segmenter once the text has been still for its idle time. One timer at a
        time, re-armed from the last delta when it fires early: not a timer per text delta."""
        if self._idle is None and self._segmenter.pending:
            self._idle = self._aloop.call_later(self.setup.segmenter.idle_timeout_s, self._poll)

    def _disarm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _poll(self) -> None:
        self._idle = None
        if self._state == "open":
            now = time.monotonic()
            self._submit(self._segmenter.poll(now))
            wait = self._segmenter.idle_in(now)
            if wait is not None:
                self._idle = self._aloop.call_later(wait, self._poll)

    def _close(self, error: BaseException | None = None, cancelled: bool = False, report: bool = True) -> None:
        """`report`: end its telemetry now (a session that finished reports once its client has
        taken the summary, or left without it: see `events` and `cancel`)."""
        self._state = "closed"
        self._disarm_idle()
        self._on_close(self)
        if report:
            self._report(error, cancelled)

    def _report(self, error: BaseException | None, cancelled: bool) -> None:
        """The session's figures and its one end line (once; the telemetry ignores a second)."""
        if self._trace is not None and self._telemetry is not None:
            cursor = self.setup.cursor
            self._telemetry.session_ended(self._trace, error, cancelled, self._chars, self._fallbacks,
                                          max(0.0, cursor.delivered_s - cursor.read_s))

    def _emit_audio(self, data: bytes, count: int, utterance: int, precision: str, fallback: bool,
                    words: list[WordTiming]) -> None:
        """Queue `count` samples of encoded `data` (plus a WAV header on the very first bytes),
        split into events of at most `max_audio_bytes`."""
        if not data and not words:
            return
        now = time.monotonic()
        if self._first_audio_at is None:
            self._first_audio_at = now
        if self._ttfa is None and self._first_text_at is not None:
            self._ttfa = now - self._first_text_at
            self._timeline.add("audio_out", sid=self.id)
            if self._trace is not None and self._telemetry is not None:
                self._telemetry.first_audio(self._trace, self._ttfa)
        if self._trace is not None and count:
            self._trace.chunk(now, count / self.setup.out_rate)
        width = self.setup.config.encoding.bytes_per_sample
        header = len(data) - count * width
        step = max(1, (self.setup.max_audio_bytes - max(header, 0)) // width)
        offset = self._output.samples_out - count
        start = 0
        while True:
            n = min(step, count - start)
            lo = 0 if start == 0 else header + start * width
            piece = data[lo : header + (start + n) * width]
            self.setup.cursor.delivered_s += n / self.setup.out_rate
            if not self._queue.put_audio(AudioOut(
                audio=piece, seq=self._seq, offset_samples=offset + start, num_samples=n,
                sample_rate=self.setup.out_rate, utterance=utterance, precision=Precision(precision),
                fallback=fallback, words=words if start == 0 else [],
            )):
                self._seq += 1
            start += n
            if start >= count:
                return

    # --- engine callbacks (on the event loop) ------------------------------------------------

    def on_chunk(self, chunk: ChunkResult) -> None:
        if self._state == "closed":
            return
        words: list[WordTiming] = []
        ratio = self.setup.out_rate / self.setup.in_rate
        if chunk.utterance not in self._utterances:
            self._utterances.add(chunk.utterance)
            self._cache_hits += int(chunk.cached)
            if self.setup.config.word_timings:
                words = [WordTiming(w, round((self._model_offset + s) * ratio), round((self._model_offset + e) * ratio))
                         for w, s, e in chunk.word_spans]
        self._model_offset += len(chunk.samples)
        self._fallbacks += int(chunk.fallback)
        before = self._output.samples_out
        pcm16 = chunk.pcm16 if chunk.pcm16 is not None and self._output.accepts_pcm16 else None
        data = self._output.convert(chunk.samples if pcm16 is None else pcm16)
        self._emit_audio(data, self._output.samples_out - before, chunk.utterance, chunk.precision,
                         chunk.fallback, words)

    def on_done(self) -> None:
        if self._state == "closed":
            return
        before = self._output.samples_out
        tail = self._output.finish()
        count = self._output.samples_out - before
        if count or (tail and self._seq == 0):
            self._emit_audio(tail, count, -1, self.setup.precision.value, False, [])
        self._queue.put(SessionSummary(
            characters=self._chars,
            audio_seconds=self._output.samples_out / self.setup.out_rate,
            ttfa_seconds=self._ttfa,
            fallbacks=self._fallbacks,
            utterances=len(self._utterances),
            chunks=self._seq,
            cache_hits=self._cache_hits,
            precision=self.setup.precision,
            precision_reason=self.setup.precision_reason,
        ))
        self._close(report=False)

    def on_error(self, exc: BaseException) -> None:
        if self._state == "closed":
            return
        self._queue.put(exc)
        self._close(error=exc)


__all__ = ["EngineSession", "SessionSetup"]
