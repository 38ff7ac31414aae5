"""The engine core in a process of its own, the layout of vLLM's V1 engine.

In one process the core's thread shares the GIL with the server's event loop (hundreds of
gRPC streams) and with the frontend's result threads; each of the core's many short native
calls gives the GIL up and may wait to get it back. Here the core, the loaded voices, the
result cache and the frontend pool live in a child process; the server keeps only the
sessions' event-loop halves. Both sides exchange pickled messages over one pipe:

server -> core: ("batch", [message, ...]), the messages of one event-loop turn, each one of
  ("open", SessionRequest, takes int16 PCM), ("text", id, text), ("end", id), ("cancel", id),
  ("read", {id: seconds read}), ("load", call, voice name), ("reset_rate",), ("settle",), ("stop",)
core -> server: ("ready", {name: LoadedVoice}) or ("failed", exception) once at start; then
  ("out", [(id, sink method, args)], [(telemetry method, args)]), ("snapshot", CoreSnapshot),
  ("reply", call, LoadedVoice or error text), ("trip", voice), ("settled",), ("died", why), ("stopped",)
  ("stopped" only once a server said stop: a core that crashed says "died", so it is not taken for a stop)

The core counts what it delivered to each session and the server reports what each client
took (coalesced per event-loop turn), so backpressure works as in one process.

Several API server processes (`serve --api-servers N`, vLLM's `--api-server-count`) share one
core: the first starts it with one pipe per server and hands the others their ends. Each
server numbers its sessions apart from the rest (`ApiSlot.session_ids`); the core answers each
session on the pipe it came from, sends its figures and trips to all, and stops when the first
server says stop (that one waits for the others). Only the first server receives the core's
telemetry, so the engine's figures are counted once."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import pickle
import queue
import selectors
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from service.audio.encoding import float_to_int16
from service.engine.config import EngineConfig
from service.engine.contract import Unavailable
from service.engine.frontend_pool import FrontendPoolConfig
from service.engine.host import (
    CoreSnapshot,
    LoadedVoice,
    Runtimes,
    build_core,
    resolve_device,
    settle_heap,
    snapshot,
)
from service.engine.memory import CORE_PROCESS_NAME, IdleTrim, name_process
from service.engine.output import Delivery, hand_over
from service.engine.state import ChunkResult, Loop, ReadCursor, SessionRequest, Sink, WorkSpec
from service.models.family import VoiceInfo
from service.telemetry import Telemetry
from service.telemetry.config import LogConfig
from service.voices import list_voices

log = logging.getLogger(__name__)

SNAPSHOT_S = 0.05  # how often the core sends its figures (admission control reads them)


@dataclass(frozen=True)
class CoreWaits:
    """How long the server waits for the core's process to answer before it gives up with an
    error naming what it waited for. Generous: a first load may export or build a voice's engines."""

    start_s: float = 1800.0  # the core loads and prepares the preloaded voices, then says ready
    load_s: float = 600.0  # one more voice
    settle_s: float = 60.0  # a full collection of its heap (then the server goes on without it)


def core_failed() -> Unavailable:
    """What open sessions end with when the core dies: the server is going away, retry elsewhere."""
    return Unavailable("the server's synthesis engine failed (see the server log); reconnect to another replica")


@dataclass(frozen=True)
class ApiSlot:
    """Which of the API server processes this one is. The first (index 0) starts the core with
    `count` pipes; the others get `conn`, their end of one of them."""

    index: int = 0
    count: int = 1
    conn: Connection | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"API server {self.index} of {self.count}")
        if (self.conn is None) != (self.index == 0):
            raise ValueError("the first API server starts the core; each other one needs its pipe")

    def session_ids(self) -> Iterator[int]:
        """Session ids no other API server uses (ids count from 1)."""
        return itertools.count(self.index + 1, self.count)


SOLE_SERVER = ApiSlot()  # one API server process: the usual case


def _dumps(message: object) -> bytes:
    """One message, pickled (one writer per pipe end: a `_PipeWriter` thread on each side)."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


class _PipeWriter:
    """Pickles and writes messages to one pipe end on a thread of its own, in the order they
    were put. A write blocks while the pipe is full (a burst's opens and texts are more than it
    holds, and the thread that reads the other end may be waiting for the GIL), and whoever
    puts (the server's event loop, the core's output stage) must never wait for that.
    `prepare` turns a message into what is pickled, on the writer's thread.

    No failure may end the thread unseen (its sessions would wait for ever): a message that
    cannot be prepared or pickled goes to `unsendable`, which fails what it concerns and returns
    the ready-to-pickle messages to send instead (the others' part of it); a failed write means
    the pipe is unusable: `broken` is told, once, and the writer stops."""

    def __init__(self, conn: Connection, name: str,
                 prepare: Callable[[Any], tuple[object, ...]] = lambda message: message,
                 unsendable: Callable[[Any, Exception], list[tuple[object, ...]]] | None = None,
                 broken: Callable[[Exception], None] | None = None) -> None:
        self._conn = conn
        self._prepare = prepare
        self._unsendable = unsendable or _dropped
        self._broken = broken or _pipe_gone
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.closed = False  # closed, or the other side is gone: what is put is dropped
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, message: object) -> None:
        if not self.closed:  # else nobody would take it out of the queue
            self._queue.put(message)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what was put, then stop."""
        if not self.closed:
            self._queue.put(_CLOSE)
            self.closed = True
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (message := self._queue.get()) is not _CLOSE:
            try:
                for data in self._encode(message):
                    self._conn.send_bytes(data)
            except Exception as exc:
                self.closed = True
                self._broken(exc)
                return

    def _encode(self, message: object) -> list[bytes]:
        if isinstance(message, _Pickled):
            return [message.data]
        try:
            return [_dumps(self._prepare(message))]
        except Exception as exc:
            return [_dumps(part) for part in self._unsendable(message, exc)]


_CLOSE = object()


def _dropped(message: Any, exc: Exception) -> list[tuple[object, ...]]:
    kind = message[0] if isinstance(message, tuple) else type(message).__name__
    log.error("could not send a %r message through the engine's pipe; dropped", kind, exc_info=exc)
    return []


def _pipe_gone(exc: Exception) -> None:
    if isinstance(exc, OSError):  # the other side is gone (its side reports why)
        log.debug("pipe closed: messages dropped")
    else:
        log.error("the engine's pipe failed; nothing more is sent through it", exc_info=exc)


@dataclass(frozen=True)
class _Pickled:
    """A message pickled once for several pipes (the core's figures go to every API server)."""

    data: bytes


# --- server side ---------------------------------------------------------------------------------


class ProcessHost:
    """Starts the core's process and relays sessions to and from it (see the module doc)."""

    def __init__(self, config: EngineConfig, device: str, backend_name: str, telemetry: Telemetry,
                 on_trip: Callable[[str], None], slot: ApiSlot = SOLE_SERVER, waits: CoreWaits = CoreWaits()) -> None:
        self.config = config
        self.slot = slot
        self.waits = waits
        self.server_conns: list[Connection] = []  # the first server: the other servers' pipe ends
        self.device = device
        self.backend_name = backend_name
        self.telemetry = telemetry
        self.on_trip = on_trip
        self.dead = threading.Event()  # the core's process died or its thread did
        self._death = threading.Lock()  # the relay and the writer may both find the core gone
        self._snapshot = CoreSnapshot()
        self._sinks: dict[int, tuple[Sink, asyncio.AbstractEventLoop]] = {}
        self._calls: dict[int, Future[LoadedVoice]] = {}
        self._call_ids = itertools.count()
        self._reads: dict[int, float] = {}
        # Session messages posted on the event loop go out together once per loop turn (one
        # pickle and one write for a turn's many streams: each write gives the GIL up, and the
        # loop may then wait for the relay thread to hand it back).
        self._batch: list[tuple[object, ...]] = []
        self._batch_due = False
        self._lock = threading.Lock()
        self._stopping = False
        self._settled = threading.Event()  # the core said it settled its heap (see settle)
        self._conn: Connection | None = None
        self._writer: _PipeWriter | None = None  # the event loop never writes to the pipe itself
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._receiver: threading.Thread | None = None

    def start(self, frontend: FrontendPoolConfig, preload: list[VoiceInfo]) -> dict[str, LoadedVoice]:
        """Start the core's process and wait until it loaded `preload`; another API server
        waits for the core's "ready" on its pipe instead (blocking: call it off the event loop)."""
        sys.setswitchinterval(self.config.batch.gil_switch_interval_s)  # the relay thread must not wait long
        if self.slot.conn is not None:
            conn = self.slot.conn
        else:
            conn = self._start_core(frontend, preload)
        self._conn = conn
        try:
            if not conn.poll(self.waits.start_s):
                self._give_up()
                raise TimeoutError(
                    f"the engine process did not say ready within {self.waits.start_s:g} s (CoreWaits.start_s) "
                    f"while loading {', '.join(v.name for v in preload)}")
            reply = _recv(conn)
        except EOFError:
            if self._proc is not None:
                self._proc.join(5)
            code = self._proc.exitcode if self._proc is not None else None
            reply = ("failed", RuntimeError(
                f"the engine process exited with code {code} while starting; see its log above"))
        if reply[0] != "ready":
            if self._proc is not None:
                self._proc.join(5)
            raise reply[1]
        self._receiver = threading.Thread(target=self._receive, name="cadenza-engine-relay", daemon=True)
        self._receiver.start()
        self._writer = _PipeWriter(conn, "cadenza-engine-sender", unsendable=self._unsendable,
                                   broken=lambda exc: self._die(f"could not write to the engine process: {exc!r}"))
        return dict(reply[1])

    def _give_up(self) -> None:
        """Stop a core process that never said ready."""
        if self._proc is not None:
            self._proc.terminate()
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)

    def _start_core(self, frontend: FrontendPoolConfig, preload: list[VoiceInfo]) -> Connection:
        """Spawn the core with one pipe per API server; this server's end is returned, the
        others' are kept in `server_conns` for their processes."""
        from service.telemetry.logs import active_config

        ctx = multiprocessing.get_context("spawn")  # CUDA and the frontend's own processes need a fresh one
        pipes = [ctx.Pipe() for _ in range(self.slot.count)]
        self._proc = ctx.Process(
            target=serve_core, name="cadenza-engine-core",
            args=([child for _, child in pipes], self.config, self.device, self.backend_name, frontend,
                  [v.name for v in preload], active_config()),
        )
        self._proc.start()
        for _, child in pipes:
            child.close()
        self.server_conns = [conn for conn, _ in pipes[1:]]
        return pipes[0][0]

    def _post(self, *message: object) -> None:
        """Send `message` to the core: at the end of this loop turn when called on an event loop
        (in order with the turn's other messages), else now."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            self._batch.append(message)
            if loop is not None:
                if not self._batch_due:
                    self._batch_due = True
                    loop.call_soon(self._flush)
                return
        self._flush()

    # Session messages one pipe message carries at most: the core's thread that reads the pipe
    # unpickles a message in one go, holding the GIL (a burst's first loop turns post hundreds of
    # opens and texts), while the engine thread needs it back after each of its native calls.
    MAX_BATCH = 64

    def _flush(self) -> None:
        """Send what was posted, as ("batch", messages) messages of at most `MAX_BATCH`, the reads last."""
        with self._lock:
            reads, self._reads = self._reads, {}
            batch, self._batch, self._batch_due = self._batch, [], False
            if reads:
                batch.append(("read", reads))
            if not batch or self._writer is None or self.dead.is_set():
                return
            for i in range(0, len(batch), self.MAX_BATCH):
                self._writer.put(("batch", batch[i : i + self.MAX_BATCH]))

    # --- what TtsEngine and the sessions call ------------------------------------------------------

    def load(self, info: VoiceInfo) -> LoadedVoice:
        """Load a voice in the core's process (blocking: call it off the event loop)."""
        call = next(self._call_ids)
        future: Future[LoadedVoice] = Future()
        self._calls[call] = future
        self._post("load", call, info.name)
        if self.dead.is_set():
            raise RuntimeError("the engine process is not running")
        try:
            return future.result(self.waits.load_s)
        except FutureTimeout:
            self._calls.pop(call, None)
            raise Unavailable(f"voice {info.name} did not load: the engine process did not answer within "
                              f"{self.waits.load_s:g} s (CoreWaits.load_s); retry shortly") from None

    def submit_open(self, request: SessionRequest, voice: VoiceInfo, sink: Sink,
                    loop: asyncio.AbstractEventLoop, cursor: ReadCursor) -> None:
        self._sinks[request.session_id] = (sink, loop)
        self._post("open", request, bool(getattr(sink, "accepts_pcm16", False)))

    def submit_text(self, session_id: int, text: str) -> None:
        self._post("text", session_id, text)

    def submit_end(self, session_id: int) -> None:
        self._post("end", session_id)

    def submit_cancel(self, session_id: int) -> None:
        self._sinks.pop(session_id, None)
        self._reads.pop(session_id, None)
        self._post("cancel", session_id)

    def taken(self, session_id: int, read_s: float, wake: bool) -> None:
        """A client took audio: reported once per event-loop turn for all sessions. `wake` is
        this side's guess; the core decides from its own count (`_Outbox.take_reads`)."""
        with self._lock:
            self._reads[session_id] = read_s
            if not self._batch_due:
                self._batch_due = True
                asyncio.get_running_loop().call_soon(self._flush)

    def snapshot(self) -> CoreSnapshot:
        return self._snapshot

    def reset_rate(self) -> None:
        self._post("reset_rate")

    def settle(self) -> None:
        """Settle both heaps; returns once the core has settled too, so the server says SERVING
        only then: sessions arriving right away would otherwise wait for the core's collection."""
        if self.slot.index > 0:  # the first server settled the core before this one started
            settle_heap()
            return
        self._settled.clear()
        self._post("settle")
        settle_heap()
        deadline = time.monotonic() + self.waits.settle_s
        while not self._settled.wait(0.1):
            if self.dead.is_set() or time.monotonic() > deadline:
                log.warning("the engine process did not say it settled its heap; going on")
                return

    def stop(self) -> None:
        """Stop the core (the first server: after the others stopped); another server's stop
        only lets the core drop its pipe."""
        self._stopping = True
        self._post("stop")
        if self._writer is not None:
            self._writer.close()  # after writing "stop" and everything before it
        if self._proc is not None:
            self._proc.join(10)
            if self._proc.is_alive():
                log.warning("the engine process did not stop; terminating it")
                self._proc.terminate()
                self._proc.join(5)
        if self._receiver is not None:
            self._receiver.join(5)
        for conn in self.server_conns:  # never handed to a server process (or already closed here)
            conn.close()

    # --- the relay thread --------------------------------------------------------------------------

    def _receive(self) -> None:
        assert self._conn is not None
        why = "the engine process exited"
        while True:
            try:
                message = _recv(self._conn)
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "out":
                self._deliver(message[1])
                for name, args in message[2]:
                    try:
                        getattr(self.telemetry, name)(*args)
                    except Exception:  # figures must never stop audio
                        log.exception("telemetry %s failed", name)
            elif kind == "snapshot":
                self._snapshot = message[1]
            elif kind == "reply":
                future = self._calls.pop(message[1], None)
                if future is not None:
                    result = message[2]
                    if isinstance(result, LoadedVoice):
                        future.set_result(result)
                    else:
                        future.set_exception(RuntimeError(result))
            elif kind == "trip":
                self.on_trip(message[1])
            elif kind == "settled":
                self._settled.set()
            elif kind == "died":
                why = message[1]
                break
            elif kind == "stopped":
                if self._stopping:
                    return
                why = "the engine process stopped unasked"
                break
        self._die(why)

    def _die(self, why: str) -> None:
        """The core is gone or cannot be reached. `dead` is set first (health reads it), then
        whatever waits on the core fails; once, whoever finds it first."""
        with self._death:
            if self.dead.is_set():
                return
            self.dead.set()
        if not self._stopping:
            log.critical("the engine core died: %s", why)
        for future in list(self._calls.values()):
            future.set_exception(RuntimeError(why))
        self._calls.clear()
        # Nothing more comes for the open sessions: end them here, not only from the server's
        # watcher (which starts once the server is up: a core dying in the warm-up would
        # otherwise leave the warm-up session, and the server's start, waiting for ever).
        ended: dict[Loop, list[Delivery]] = {}
        for sink, loop in list(self._sinks.values()):
            ended.setdefault(loop, []).append((sink, "on_error", (core_failed(),)))
        self._sinks.clear()
        hand_over(ended)

    def _unsendable(self, message: tuple[str, list[tuple[Any, ...]]], exc: Exception) -> list[tuple[object, ...]]:
        """A batch the writer cannot pickle: fail each session (or voice load) whose message
        cannot be, tell the core to drop those sessions, send the rest."""
        kept: list[tuple[Any, ...]] = []
        ended: dict[Loop, list[Delivery]] = {}
        for item in message[1]:
            try:
                _dumps(item)
            except Exception as error:
                kind = item[0]
                what = f"{type(error).__name__}: {error}"
                log.error("could not send a %r message to the engine process: %s", kind, what, exc_info=error)
                if kind == "load" and (future := self._calls.pop(item[1], None)) is not None:
                    future.set_exception(RuntimeError(f"the voice load could not be sent to the engine process "
                                                      f"({what})"))
                elif kind in ("open", "text", "end", "cancel"):
                    session_id = item[1].session_id if kind == "open" else item[1]
                    kept.append(("cancel", session_id))
                    entry = self._sinks.pop(session_id, None)
                    if entry is not None:
                        failed = RuntimeError(f"the session's {kind} message could not be sent to the engine "
                                              f"process ({what})")
                        ended.setdefault(entry[1], []).append((entry[0], "on_error", (failed,)))
            else:
                kept.append(item)
        hand_over(ended)
        return [("batch", kept)] if kept else []

    def _deliver(self, items: Sequence[tuple[int, str, tuple[object, ...]]]) -> None:
        """Hand one flush of the core's results to the sessions' event loops, one wake-up each."""
        batches: dict[Loop, list[Delivery]] = {}
        for session_id, method, args in items:
            entry = self._sinks.get(session_id)
            if entry is None:  # cancelled meanwhile
                continue
            if method != "on_chunk":
                self._sinks.pop(session_id, None)
            batches.setdefault(entry[1], []).append((entry[0], method, args))
        hand_over(batches)


# --- core side -----------------------------------------------------------------------------------


@dataclass
class _RemoteSink:
    """Stands for a session of the server inside the core's process."""

    session_id: int
    cursor: ReadCursor
    sample_rate: int
    # The session's output is made from 16-bit PCM at the voice's rate: its chunks cross as int16
    # (converted on the outbox's thread, half the bytes, no conversion on the server's event loop).
    pcm16: bool = False


@dataclass
class _Flush:
    """One output flush on its way to the server: deliveries (session id, sink method, args),
    the core's telemetry calls, and which deliveries are chunks of sessions taking int16 PCM."""

    out: list[tuple[int, str, tuple[Any, ...]]]
    telemetry: list[tuple[str, tuple[object, ...]]]
    pcm16: list[int]

    def wire(self) -> tuple[object, ...]:
        """The ("out", ...) message. Chunks of sessions taking int16 cross as the step's own PCM
        (made by the guard on the device), else (cache replays, the CPU's staged decoder)
        converted here; the others as float32 alone."""
        pcm16 = set(self.pcm16)
        return ("out", [_wired(item, i in pcm16) for i, item in enumerate(self.out)], self.telemetry)


def _wired(item: tuple[int, str, tuple[Any, ...]], pcm16: bool) -> tuple[int, str, tuple[Any, ...]]:
    """One delivery as it crosses the pipe (see `_Flush.wire`)."""
    session_id, method, args = item
    if method != "on_chunk":
        return item
    chunk: ChunkResult = args[0]
    if pcm16:
        samples = chunk.pcm16 if chunk.pcm16 is not None else float_to_int16(chunk.samples)
        return session_id, method, (dataclasses.replace(chunk, samples=samples, pcm16=None),)
    if chunk.pcm16 is not None:
        return session_id, method, (dataclasses.replace(chunk, pcm16=None),)
    return item


class _Outbox:
    """The core's way back to the server: the output stage hands it each flush as if it were
    an event loop; a sender thread pickles and writes, so the core's thread never waits on
    the pipe."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        # A flush's int16 chunks are converted on the writer's thread, off the engine thread.
        self._writer = _PipeWriter(conn, "cadenza-engine-outbox",
                                   lambda m: m.wire() if isinstance(m, _Flush) else m, unsendable=self._unsendable)
        self._telemetry: list[tuple[str, tuple[object, ...]]] = []
        self._tlock = threading.Lock()
        self.cursors: dict[int, ReadCursor] = {}
        self.lost: Callable[[int], None] = lambda session_id: None  # the core drops a session (`_unsendable`)

    def _unsendable(self, message: object, exc: Exception) -> list[tuple[object, ...]]:
        """A flush the writer cannot convert or pickle: each session with a delivery that cannot
        be gets an error instead (and the core drops it); the others' deliveries go."""
        if not isinstance(message, _Flush):
            return _dropped(message, exc)
        pcm16 = set(message.pcm16)
        out: list[tuple[int, str, tuple[Any, ...]]] = []
        failed: set[int] = set()
        for i, item in enumerate(message.out):
            session_id = item[0]
            if session_id in failed:
                continue
            try:
                wired = _wired(item, i in pcm16)
                _dumps(wired)
            except Exception as error:
                what = f"{type(error).__name__}: {error}"
                log.error("could not send session %d's %s to the API server: %s", session_id, item[1], what,
                          exc_info=error)
                failed.add(session_id)
                self.cursors.pop(session_id, None)
                self.lost(session_id)
                wired = (session_id, "on_error", (RuntimeError(
                    f"this session's output could not be sent to the API server ({what})"),))
            out.append(wired)
        telemetry = message.telemetry
        try:
            _dumps(telemetry)
        except Exception as error:
            log.error("could not send the core's telemetry to the API server; dropped", exc_info=error)
            telemetry = []
        return [("out", out, telemetry)]

    def send(self, *message: object) -> None:
        self._writer.put(message)

    def send_pickled(self, message: _Pickled) -> None:
        self._writer.put(message)

    # Audio one pipe message carries at most (bytes as sent; a flush with more goes as several).
    # Pickling a message holds the GIL from start to end (C code: no bytecode to switch at), and
    # the engine thread needs the GIL back after each of its native calls: a whole step's output
    # in one message kept it waiting for milliseconds.
    MAX_MESSAGE_AUDIO_BYTES = 1 << 20

    def call_soon_threadsafe(self, callback: Callable[..., object], *args: object) -> None:
        """Called by `OutputStage.flush` with `run_all` and one flush's deliveries."""
        calls: list[tuple[_RemoteSink, str, tuple[object, ...]]] = args[0]  # type: ignore[assignment]
        out: list[tuple[int, str, tuple[Any, ...]]] = []
        pcm16: list[int] = []  # which of `out` are chunks for sessions that take int16 PCM
        audio_bytes = 0
        for sink, method, call_args in calls:
            if method == "on_chunk":
                samples = len(call_args[0].samples)  # type: ignore[attr-defined]
                sink.cursor.delivered_s += samples / sink.sample_rate
                if sink.pcm16:
                    pcm16.append(len(out))
                audio_bytes += samples * (2 if sink.pcm16 else 4)
            else:
                self.cursors.pop(sink.session_id, None)
                if method == "on_error":
                    call_args = (_portable(call_args[0]),)  # type: ignore[arg-type]
            out.append((sink.session_id, method, call_args))
            if audio_bytes >= self.MAX_MESSAGE_AUDIO_BYTES:
                self._writer.put(_Flush(out, [], pcm16))
                out, pcm16, audio_bytes = [], [], 0
        self._writer.put(_Flush(out, self.take_telemetry(), pcm16))  # the telemetry goes with the last part

    def take_reads(self, reads: Mapping[int, float], limit_s: float) -> bool:
        """Apply the server's read cursors; True when one of them let a session that was held
        back (`limit_s` or more unread, as the core counts it) step again. Decided here, from what
        the core delivered: audio still in the pipe counts as delivered for the core but not yet
        for the server, so a client that keeps up with a slow pipe never looks held back there."""
        wake = False
        for session_id, read_s in reads.items():
            cursor = self.cursors.get(session_id)
            if cursor is not None:
                unread = cursor.delivered_s - cursor.read_s
                cursor.read_s = read_s
                wake = wake or (unread >= limit_s and cursor.delivered_s - read_s < limit_s)
        return wake

    def record(self, name: str, args: tuple[object, ...]) -> None:
        with self._tlock:
            self._telemetry.append((name, args))

    def take_telemetry(self) -> list[tuple[str, tuple[object, ...]]]:
        with self._tlock:
            taken, self._telemetry = self._telemetry, []
        return taken

    def send_telemetry(self) -> None:
        """What was recorded since the last flush, without audio."""
        if pending := self.take_telemetry():
            self.send("out", [], pending)

    def close(self) -> None:
        self._writer.close(5)


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


# The Telemetry methods the core calls (the rest belong to the server's sessions and RPCs).
FORWARDED = ("utterance_queued", "first_audio_stages", "acoustic_step", "decoder_step", "utterance_done",
             "utterance_dropped", "shadow_psnr")


class _ForwardedTelemetry(Telemetry):
    """The core's telemetry calls, recorded and replayed by the server on its own Telemetry
    (spans and metrics stay in one place, with the sessions' traces)."""

    def __init__(self, outbox: _Outbox) -> None:
        super().__init__()
        self._outbox = outbox


def _forward(name: str) -> Callable[..., None]:
    def record(self: _ForwardedTelemetry, *args: object) -> None:
        self._outbox.record(name, args)

    record.__name__ = name
    return record


for _name in FORWARDED:
    setattr(_ForwardedTelemetry, _name, _forward(_name))


def serve_core(conns: Sequence[Connection], config: EngineConfig, device: str, backend_name: str,
               frontend: FrontendPoolConfig, preload: list[str], log_config: LogConfig | None) -> None:
    """The core process's main: load, start the core, then apply the servers' messages (one
    pipe per API server; the first one's "stop" or its going away stops the core)."""
    # Ctrl-C reaches the whole process group: the server drains its sessions, then stops the core.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name_process(CORE_PROCESS_NAME)
    if log_config is not None:
        from service.telemetry.logs import setup_logging

        setup_logging(log_config)
    outboxes = [_Outbox(conn) for conn in conns]
    first = outboxes[0]

    def to_all(*message: object) -> None:
        pickled = _Pickled(_dumps(message))
        for outbox in outboxes:
            outbox.send_pickled(pickled)

    try:
        device = resolve_device(device)  # "auto": here, where torch is loaded anyway
        voices: Mapping[str, VoiceInfo] = {v.name: v for v in list_voices(config.voices_dir)}
        runtimes = Runtimes(config, device, backend_name)
        loaded = {name: runtimes.prepare(voices[name]) for name in preload}
        core = build_core(config, _ForwardedTelemetry(first), on_trip=lambda voice: to_all("trip", voice))
        core.frontend_config = frontend
        core.start()
        for outbox in outboxes:
            outbox.lost = core.submit_cancel
    except Exception as exc:  # raised again by the server (a bad option reads as it does without a process)
        log.debug("the engine process could not start", exc_info=True)
        first.send("failed", _portable(exc))
        for outbox in outboxes:
            outbox.close()
        return
    to_all("ready", loaded)
    stop = threading.Event()
    idle = IdleTrim()  # memory the sessions freed goes back to the system once none is left

    def tick() -> None:
        while not stop.wait(SNAPSHOT_S):
            if core.dead.is_set():
                to_all("died", f"the engine thread died: {core.death!r}")
                return
            figures = dataclasses.replace(snapshot(core, device),
                                          open_sessions=tuple(len(o.cursors) for o in outboxes))
            to_all("snapshot", figures)
            first.send_telemetry()
            idle.update(busy=figures.active_work > 0 or any(figures.open_sessions))

    threading.Thread(target=tick, name="cadenza-engine-ticker", daemon=True).start()

    def load(outbox: _Outbox, call: int, name: str) -> None:
        try:
            outbox.send("reply", call, runtimes.describe(voices[name]))
        except Exception as exc:
            log.exception("could not load voice %s", name)
            outbox.send("reply", call, f"cannot load voice {name}: {type(exc).__name__}: {exc}")

    def apply(message: tuple[Any, ...], outbox: _Outbox) -> bool:
        """Apply one of a server's messages; False once it says stop."""
        kind = message[0]
        if kind == "text":
            core.submit_text(message[1], message[2])
        elif kind == "read":
            if outbox.take_reads(message[1], config.batch.max_ahead_s):
                core.poke()
        elif kind == "open":
            request: SessionRequest = message[1]
            runtime = runtimes.get(voices[request.voice_name])
            cursor = outbox.cursors[request.session_id] = ReadCursor()
            sink = _RemoteSink(request.session_id, cursor, runtime.sample_rate, pcm16=bool(message[2]))
            core.submit_open(WorkSpec.of(request, runtime, sink, outbox, cursor))  # type: ignore[arg-type]
        elif kind == "end":
            core.submit_end(message[1])
        elif kind == "cancel":
            outbox.cursors.pop(message[1], None)
            core.submit_cancel(message[1])
        elif kind == "load":
            threading.Thread(target=load, args=(outbox, *message[1:]), name="cadenza-voice-load",
                             daemon=True).start()
        elif kind == "reset_rate":
            core.reset_rate()
        elif kind == "settle":
            settle_heap()
            outbox.send("settled")
        elif kind == "stop":
            return False
        return True

    def let_go(outbox: _Outbox) -> None:
        """Another API server stopped or went away: cancel what it left open, answer no more."""
        if outbox.cursors:
            log.warning("an API server process went away with %d open session(s); cancelling them",
                        len(outbox.cursors))
        for session_id in list(outbox.cursors):
            outbox.cursors.pop(session_id, None)
            core.submit_cancel(session_id)
        outbox.send("stopped")
        outbox.close()

    reading = dict(zip(conns, outboxes, strict=True))
    # One selector for as long as the pipes are open (`multiprocessing.connection.wait` builds one
    # at every call, holding the GIL the engine thread waits for after each native call).
    selector = selectors.DefaultSelector()
    for each in conns:
        selector.register(each, selectors.EVENT_READ)
    crash: Exception | None = None
    try:
        while first.conn in reading:
            for one in [key.fileobj for key, _ in selector.select()]:
                conn: Connection = one  # type: ignore[assignment]  # registered as a Connection
                outbox = reading[conn]
                try:
                    batch = _recv(conn)
                except (EOFError, OSError):  # that server is gone
                    go_on = False
                else:
                    assert batch[0] == "batch"
                    go_on = all(apply(message, outbox) for message in batch[1])
                if not go_on:
                    del reading[conn]
                    selector.unregister(conn)
                    if outbox is not first:
                        let_go(outbox)
    except Exception as exc:
        crash = exc
        log.critical("the engine core crashed", exc_info=True)
    finally:
        selector.close()
        stop.set()
        if crash is not None:  # said before the core's stop fails the sessions as if stopped on purpose
            to_all("died", f"the engine core crashed: {crash!r}")
        core.stop()
        first.send_telemetry()
        for outbox in reading.values():  # servers still attached (the first stopped before them)
            if outbox is not first:
                outbox.send("died", "the engine core stopped")
                outbox.close()
        if crash is None:
            first.send("stopped")
        first.close()
    if crash is not None:
        sys.exit(1)
