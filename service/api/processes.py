"""The other API server processes of `serve --api-servers N` (vLLM's `--api-server-count`).

One process's Python takes a burst of new streams in one after the other: each stream's
callbacks, its request parsing and its audio writes hold that process's GIL. The first server
(the one `cadenza serve` runs) starts the engine core with one pipe per API server, warms it
up, and then starts the others here. Each of them is a whole `CadenzaServer` on the same port
(SO_REUSEPORT: the kernel spreads connections over the processes) whose engine talks to the
running core through its pipe. They drain when the first one drains (it forwards the signal)
and the core stops after the last of them. One that dies leaves the others serving: the core
cancels its sessions and the kernel stops handing it connections."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import queue
import signal
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from service.telemetry import Telemetry
from service.telemetry.config import LogConfig

if TYPE_CHECKING:
    from service.api.server import CadenzaServer, ServerConfig

log = logging.getLogger(__name__)


class ApiServers:
    """Starts, watches, drains and stops the API server processes after the first."""

    START_TIMEOUT_S = 120.0  # each has to import gRPC and its servicers, then find the core ready
    STOP_MARGIN_S = 10.0  # beyond the drain grace, before a process that has not stopped is killed

    def __init__(self, config: ServerConfig, port: int, conns: Sequence[Connection], telemetry: Telemetry) -> None:
        self.config = config
        self.port = port
        self.conns = list(conns)
        self.telemetry = telemetry  # the first server's: its metrics endpoint adds the others' up
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self._signalled = False
        self._reported: set[int] = set()

    def start(self) -> None:
        """Start every other server; returns once all are serving (blocking: off the event loop).
        RuntimeError, with the others stopped, when one cannot start."""
        from service.telemetry.logs import active_config

        ctx = multiprocessing.get_context("spawn")
        ready: multiprocessing.Queue[tuple[int, int | None, str | None]] = ctx.Queue()
        for index, conn in enumerate(self.conns, start=1):
            proc = ctx.Process(target=run_api_server, name=f"cadenza-api-{index + 1}",
                               args=(self.config, index, self.port, conn, ready, active_config()))
            proc.start()
            conn.close()  # the child has its copy: the core sees that server go away when it does
            self.procs.append(proc)
        waiting = set(range(1, len(self.procs) + 1))
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while waiting:
            try:
                index, metrics_port, error = ready.get(timeout=0.5)
            except queue.Empty:
                index, metrics_port, error = self._not_starting(waiting, deadline)
                if error is None:
                    continue
            if error is not None:
                self.stop(0.0)
                raise RuntimeError(f"API server process {index + 1} of {self.config.api_servers} could not start: "
                                   f"{error} (see its log above)")
            waiting.discard(index)
            if metrics_port is not None and self.telemetry.metrics_also is not None:
                self.telemetry.metrics_also.append(f"http://127.0.0.1:{metrics_port}/metrics")
        log.info("%d API server processes on port %d", len(self.procs) + 1, self.port)

    def _not_starting(self, waiting: set[int], deadline: float) -> tuple[int, None, str | None]:
        """(index, None, why) for a process still awaited that will not start (it exited, or the
        deadline passed); (0, None, None) while they may yet."""
        for index in sorted(waiting):
            if not self.procs[index - 1].is_alive():
                return index, None, f"exited with code {self.procs[index - 1].exitcode}"
        if time.monotonic() > deadline:
            return min(waiting), None, f"did not start within {self.START_TIMEOUT_S:.0f} s"
        return 0, None, None

    def check(self) -> None:
        """Log each process that exited while it should be serving (once; the rest go on)."""
        if self._signalled:
            return
        for index, proc in enumerate(self.procs, start=1):
            if index not in self._reported and not proc.is_alive():
                self._reported.add(index)
                log.error("API server process %d (pid %s) exited with code %s; its sessions ended, the "
                          "other processes keep serving", index + 1, proc.pid, proc.exitcode)

    def drain(self) -> None:
        """Tell every process to drain (SIGTERM: each refuses new sessions and lets its open
        ones finish within the grace period, as the first one does)."""
        self._signalled = True
        for proc in self.procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)

    def stop(self, grace_s: float) -> None:
        """Drain them if not yet told, wait up to `grace_s` (plus a margin) for them to stop,
        then kill what is left (blocking)."""
        if not self._signalled:
            self.drain()
        deadline = time.monotonic() + grace_s + self.STOP_MARGIN_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.warning("API server process %s did not stop; killing it", proc.name)
                proc.kill()
                proc.join(5)


def run_api_server(config: ServerConfig, index: int, port: int, conn: Connection,
                   ready: multiprocessing.Queue[tuple[int, int | None, str | None]],
                   log_config: LogConfig | None) -> None:
    """An API server process's main: serve on `port` with the running core behind `conn`
    until SIGTERM (sent by the first server), then drain."""
    # Ctrl-C reaches the whole process group: the first server drains, then tells this one to.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if log_config is not None:
        from service.telemetry.logs import setup_logging

        setup_logging(log_config)
    from service.api.server import serve
    from service.engine.proc import ApiSlot

    def on_ready(server: CadenzaServer) -> None:
        ready.put((index, server.telemetry.metrics_port, None))

    try:
        asyncio.run(serve(dataclasses.replace(config, port=port), on_ready=on_ready,
                          slot=ApiSlot(index, config.api_servers, conn)))
    except Exception as exc:
        log.debug("API server process %d failed", index, exc_info=True)
        ready.put((index, None, f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None


__all__ = ["ApiServers", "run_api_server"]
