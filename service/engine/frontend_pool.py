"""Phonemise in worker processes, so session starts are not serialised on one espeak lock.

espeak-ng (through ``piper.espeakbridge``) is process-global and guarded by one lock, so in one
process every text is phonemised after the previous one. ``FrontendPool`` runs the text
frontend in ``workers`` spawned processes instead (``workers=0``: in this process, on one
thread, as before). Each worker builds a voice's frontend once, through its model family
(``VoiceInfo.frontend_key``), the first time it is asked for that voice (or at start, for ``preload`` voices).

Design: a shared request queue and one parent thread per worker process, talking to it over
its own pipe. In a burst a thread keeps a second request waiting in the pipe, so its worker
starts the next text as soon as it has sent a result. So a worker that dies (killed, or
crashed inside espeak) loses nothing: its thread starts a new process and sends it the
requests it held again; the one that was running gets that second try only, and fails with
``BrokenProcessPool`` if it kills that worker too. Queued requests and those on other
workers are untouched. A worker found dead while idle is replaced before its next request.

Errors raised by the frontend in a worker (``AnnotationError`` for an unknown ARPAbet symbol,
say) are sent back as the exception object, without its traceback, and the future raises the
same type with the same message. An exception that does not survive pickling becomes a
``RuntimeError`` naming the original type.

Results of different requests can finish in any order; callers that need a session's texts
in order keep their futures in order.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing.context import SpawnProcess
from pathlib import Path
from typing import Any

from service.models.family import TextFrontend
from service.text.frontend import PhonemizedSentence

VoiceKey = str | os.PathLike[str]
"""A voice's Piper config (``.onnx.json``) path, or what ``find_voice`` accepts: a voice
name (the built-in ``en_US-joe-medium``, or one in ``voices_dir``) or a ``.onnx`` path."""


def default_workers() -> int:
    """Half the CPUs this process may run on (at least 2, at most 8, never more than there
    are): espeak for a burst of starts spreads over them, and the other half is left to the
    engine thread, the event loop and gRPC."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus, max(2, cpus // 2)))

_WARM_TEXT = "Hello."
_STOP_TIMEOUT_S = 5.0
_PIPELINE_DEPTH = 2
_PIPELINE_CHARS = 8192
_START_TRIES = 3


@dataclass(frozen=True)
class FrontendPoolConfig:
    """``workers``: frontend processes; 0 phonemises in this process on one thread; None:
    ``default_workers()``, decided when the pool starts.
    ``voices_dir``: where voice names (not paths) are looked up, as ``find_voice`` does.
    ``preload``: voices every worker loads, and phonemises a word with, before its first
    request (and again after a restart), so the first sessions do not pay for it."""

    workers: int | None = None
    voices_dir: Path | None = None
    preload: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 0:
            raise ValueError(f"workers must be >= 0, not {self.workers}")


def resolve_frontend_key(key: VoiceKey, voices_dir: Path | None = None) -> str:
    """A voice's frontend key (`VoiceInfo.frontend_key`, "<family>:<source>"), from such a key,
    a voice name or a voice's file."""
    name = os.fspath(key)
    family, sep, _ = name.partition(":")
    from service.models.registry import FAMILIES

    if sep and family in FAMILIES:
        return name
    from service.voices import find_voice

    return find_voice(name, voices_dir).frontend_key


class _FrontendCache:
    """Frontend per voice frontend key, built on first use (one per process)."""

    def __init__(self) -> None:
        self._frontends: dict[str, TextFrontend] = {}

    def get(self, key: str) -> TextFrontend:
        found = self._frontends.get(key)
        if found is None:
            from service.models.registry import open_frontend

            found = self._frontends[key] = open_frontend(key)
        return found

    def warm(self, frontend_keys: Sequence[str]) -> None:
        """Load these voices' frontends and run each once (espeak: initialise, load its dictionary)."""
        for frontend_key in frontend_keys:
            try:
                self.get(frontend_key).sentences(_WARM_TEXT)
            except Exception:
                pass  # the first real request reports the problem, with its own message


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles back to the same type and message, else a RuntimeError naming it."""
    try:
        clone = pickle.loads(pickle.dumps(exc))
        if type(clone) is type(exc) and str(clone) == str(exc):
            return exc
    except Exception:
        pass
    return RuntimeError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")


def _worker_main(conn: multiprocessing.connection.Connection, preload: tuple[str, ...]) -> None:
    """A frontend worker process: ("ready",) once warm, then one reply per request."""
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cache = _FrontendCache()
    cache.warm(preload)
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return  # parent gone
        if request is None:
            return
        frontend_key, text, dictionary, words = request
        try:
            reply: tuple[str, Any] = ("ok", cache.get(frontend_key).sentences(text, dictionary, words=words))
        except Exception as exc:
            reply = ("err", _portable(exc.with_traceback(None)))
        try:
            conn.send(reply)
        except Exception as exc:  # pickling failed; nothing was written yet
            conn.send(("err", RuntimeError(f"frontend result could not be sent back: {exc}")))


@dataclass
class _Request:
    future: Future[list[PhonemizedSentence]]
    frontend_key: str
    text: str
    dictionary: dict[str, str] | None
    words: bool = True  # align words (Frontend.sentences)
    deaths: int = 0  # worker deaths while this request was the one running

    @property
    def message(self) -> tuple[str, str, dict[str, str] | None, bool]:
        return (self.frontend_key, self.text, self.dictionary, self.words)

    @property
    def small(self) -> bool:
        """Small enough to wait in the pipe behind another request: writing it never blocks
        (so neither side can block the other with a large reply)."""
        return len(self.text) + sum(len(k) + len(v) for k, v in (self.dictionary or {}).items()) < _PIPELINE_CHARS


class _WorkerDied(Exception):
    pass


class _Worker:
    """One worker process and the parent thread that feeds it; or, ``inline``, a thread that
    runs the frontend itself (workers=0).

    Up to ``_PIPELINE_DEPTH`` requests are in the worker's pipe at once, so in a burst it
    starts the next text as soon as it has sent a result, without waiting for this thread
    to wake up (on a 2-core VM that round trip cost a quarter of the throughput). The oldest
    request in flight is the one running."""

    def __init__(self, pool: FrontendPool, index: int, inline: bool = False) -> None:
        self.pool = pool
        self.index = index
        self.cache = _FrontendCache() if inline else None
        self.spawned = 0
        self.broken = False  # the process died (its pipe can close before is_alive() turns False)
        self.process: SpawnProcess | None = None
        self.conn: multiprocessing.connection.Connection | None = None
        self.inflight: deque[_Request] = deque()
        self.stopping = False  # took the end marker
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"cadenza-frontend-{index}", daemon=True)

    # -- process lifecycle -------------------------------------------------------------------

    def _spawn(self) -> multiprocessing.connection.Connection:
        """Replace the process with a new one, warm; _WorkerDied if it dies first."""
        self.broken = True
        with self.pool._life_lock:
            if self.pool._stopped:
                raise _WorkerDied("frontend pool is closed")
            self.stop_process()
            ctx = multiprocessing.get_context("spawn")
            conn, child_conn = ctx.Pipe(duplex=True)
            process = ctx.Process(
                target=_worker_main,
                args=(child_conn, self.pool._preload_paths),
                name=f"cadenza-frontend-{self.index}",
                daemon=True,
            )
            process.start()
            child_conn.close()  # so that recv here sees EOF when the child dies
            self.process, self.conn = process, conn
            self.spawned += 1
        try:
            conn.recv()  # ("ready", None)
        except (EOFError, OSError) as exc:
            raise _WorkerDied(f"frontend worker {self.index} died while starting") from exc
        self.broken = False
        return conn

    def stop_process(self) -> None:
        """Ask the process to exit, then terminate or kill it if it does not (caller holds
        the pool's life lock)."""
        process, conn = self.process, self.conn
        self.process = self.conn = None
        if conn is not None:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        if process is not None:
            process.join(_STOP_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
                process.join(_STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
            process.close()
        if conn is not None:
            conn.close()

    def _alive(self) -> bool:
        return not self.broken and self.conn is not None and self.process is not None and self.process.is_alive()

    def _recover(self, blame: bool) -> None:
        """A new process, and every request in flight sent to it again. ``blame``: the old
        one died while running the oldest request, which fails if that was its second try.
        A process that dies while starting is nobody's fault; after ``_START_TRIES`` of
        those in a row, the requests in flight fail."""
        if blame:
            self._blame_head()
        for _ in range(_START_TRIES):
            if self.pool._stopped:
                self._fail_inflight(RuntimeError("FrontendPool closed while the request ran"))
                return
            if not self.inflight:
                return  # started again by the next request
            try:
                conn = self._spawn()
            except _WorkerDied:
                continue
            try:
                for request in self.inflight:
                    conn.send(request.message)
                return
            except OSError:  # died again, with the oldest request running
                self.broken = True
                self._blame_head()
        self._fail_inflight(BrokenProcessPool(f"frontend worker {self.index} could not be started"))

    def _blame_head(self) -> None:
        if self.inflight:
            head = self.inflight[0]
            head.deaths += 1
            if head.deaths >= 2:
                self.inflight.popleft()
                head.future.set_exception(BrokenProcessPool(
                    f"frontend worker {self.index} died twice while phonemising {head.text[:40]!r}"
                ))

    def _fail_inflight(self, exc: BaseException) -> None:
        while self.inflight:
            self.inflight.popleft().future.set_exception(exc)

    # -- requests ----------------------------------------------------------------------------

    def _send(self, request: _Request) -> None:
        self.inflight.append(request)
        if not self._alive():
            self._recover(blame=False)  # found dead while idle: not this request's doing
            return
        assert self.conn is not None
        try:
            self.conn.send(request.message)
        except OSError:
            self.broken = True
            self._recover(blame=len(self.inflight) > 1)

    def _receive(self) -> None:
        assert self.conn is not None
        try:
            reply: tuple[str, Any] = self.conn.recv()
        except (EOFError, OSError):
            self.broken = True
            self._recover(blame=True)
            return
        request = self.inflight.popleft()
        if reply[0] == "ok":
            request.future.set_result(reply[1])
        else:
            request.future.set_exception(reply[1])

    def _take(self, block: bool) -> _Request | None:
        """The next request that is not cancelled; None at the end (or, not blocking, when
        there is none queued). Sets ``self.stopping`` on the end marker."""
        while True:
            try:
                _, _, request = self.pool._queue.get(block)
            except queue.Empty:
                return None
            if request is None:
                self.stopping = True
                return None
            if request.future.set_running_or_notify_cancel():
                return request

    def _run_inline(self, cache: _FrontendCache) -> None:
        cache.warm(self.pool._preload_paths)
        self.ready.set()
        while (request := self._take(block=True)) is not None:
            try:
                frontend = cache.get(request.frontend_key)
                request.future.set_result(frontend.sentences(request.text, request.dictionary, words=request.words))
            except BaseException as exc:
                request.future.set_exception(exc)

    def _run(self) -> None:
        if self.cache is not None:
            self._run_inline(self.cache)
            return
        try:
            self._spawn()
        except _WorkerDied:
            pass  # started again by its first request
        self.ready.set()
        try:
            while not (self.stopping and not self.inflight):
                # Block for work only with nothing in flight; else top up from what is queued
                # (in a burst), leaving sparse arrivals to idle workers.
                while not self.stopping and len(self.inflight) < _PIPELINE_DEPTH:
                    request = self._take(block=not self.inflight)
                    if request is None:
                        break
                    if self.inflight and not request.small:
                        self._receive_all()  # a large one goes alone
                    self._send(request)
                if self.inflight:
                    self._receive()
        except BaseException as exc:  # never leave a future unresolved
            while self.inflight:
                request = self.inflight.popleft()
                if not request.future.done():
                    request.future.set_exception(exc)
            raise
        finally:
            with self.pool._life_lock:
                self.stop_process()

    def _receive_all(self) -> None:
        while self.inflight:
            self._receive()


class FrontendPool:
    """The text frontend across worker processes; ``submit`` may be called from any thread."""

    def __init__(self, config: FrontendPoolConfig | None = None) -> None:
        config = config or FrontendPoolConfig()
        if config.workers is None:
            config = dataclasses.replace(config, workers=default_workers())
        self.config = config
        self._submit_lock = threading.Lock()  # closing + queueing
        self._life_lock = threading.Lock()  # starting and stopping processes
        self._closing = False  # no new requests
        self._stopped = False  # no new processes
        self._paths: dict[str, str] = {}
        self._preload_paths = tuple(self._resolve(key) for key in self.config.preload)
        # (priority, order, request): lower priority values first, then first come first served;
        # the end markers (None) sort last.
        self._queue: queue.PriorityQueue[tuple[float, int, _Request | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._workers = [_Worker(self, i) for i in range(self.workers)] or [_Worker(self, 0, inline=True)]
        for worker in self._workers:
            worker.thread.start()

    @property
    def workers(self) -> int:
        assert self.config.workers is not None
        return self.config.workers

    @property
    def worker_pids(self) -> list[int]:
        """Pids of the live worker processes (empty for workers=0)."""
        pids = []
        for worker in self._workers:
            process = worker.process
            try:
                if process is not None and process.pid is not None and process.is_alive():
                    pids.append(process.pid)
            except ValueError:
                pass  # closed meanwhile
        return pids

    @property
    def worker_restarts(self) -> int:
        """How many worker processes were started to replace one that died."""
        return sum(max(0, worker.spawned - 1) for worker in self._workers)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every worker has started and loaded the preload voices."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for worker in self._workers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not worker.ready.wait(left):
                return False
        return True

    def submit(
        self, voice: VoiceKey, text: str, custom_dictionary: Mapping[str, str] | None = None, priority: float = 0,
        words: bool = True,
    ) -> Future[list[PhonemizedSentence]]:
        """Phonemise ``text`` with ``voice``'s frontend, as ``Frontend.sentences`` does.
        Requests with a lower ``priority`` are taken first (the engine puts a session's first
        text ahead of the later texts of sessions already speaking).

        ``voice``: its frontend key (``VoiceInfo.frontend_key``), a voice name or a voice's file. The future holds
        the sentences, or the exception the frontend raised (same type and message). ``words``:
        as ``Frontend.sentences`` takes it."""
        if self._closing:
            raise RuntimeError("FrontendPool is closed")
        future: Future[list[PhonemizedSentence]] = Future()
        try:
            frontend_key = self._resolve(voice)
        except Exception as exc:
            future.set_exception(exc)
            return future
        dictionary = dict(custom_dictionary) if custom_dictionary else None
        with self._submit_lock:
            if self._closing:
                raise RuntimeError("FrontendPool is closed")
            self._queue.put((priority, next(self._order), _Request(future, frontend_key, text, dictionary, words)))
        return future

    def close(self, cancel_pending: bool = True) -> None:
        """Stop taking requests, cancel the queued ones (or, ``cancel_pending=False``, finish
        them), let running ones finish, and wait until every worker process has exited."""
        with self._submit_lock:
            if self._closing:
                return
            self._closing = True
            if cancel_pending:
                self._cancel_queued()
            for _ in self._workers:
                self._queue.put((math.inf, next(self._order), None))  # after every request queued so far
        for worker in self._workers:
            worker.thread.join(_STOP_TIMEOUT_S * 3)
        with self._life_lock:
            self._stopped = True
            for worker in self._workers:  # any thread still stuck in a request
                worker.stop_process()

    def _cancel_queued(self) -> None:
        while True:
            try:
                _, _, request = self._queue.get_nowait()
            except queue.Empty:
                return
            if request is not None:
                request.future.cancel()
                request.future.set_running_or_notify_cancel()  # wakes wait() and as_completed()

    def _resolve(self, key: VoiceKey) -> str:
        name = os.fspath(key)
        path = self._paths.get(name)
        if path is None:
            path = resolve_frontend_key(key, self.config.voices_dir)
            self._paths[name] = path  # a race only computes it twice
        return path

    def __enter__(self) -> FrontendPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
