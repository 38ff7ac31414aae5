"""The grpc.aio server: native servicer, health, reflection, limits and SIGTERM drain."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.api.gen.cadenza.v1 import tts_pb2
from service.api.google_tts import add_google
from service.api.native import add_native
from service.api.ports import DEFAULT_HOST, DEFAULT_PORT, PortInUseError, check_port_free
from service.api.riva import add_riva
from service.engine.api import Engine
from service.engine.config import EngineConfig, Limits
from service.engine.engine import TtsEngine

__all__ = ["CadenzaServer", "PortInUseError", "ServerConfig", "serve"]

log = logging.getLogger(__name__)

NATIVE_SERVICE = tts_pb2.DESCRIPTOR.services_by_name["TextToSpeech"].full_name
AddServicer = Callable[[grpc.aio.Server, Engine], None]


@dataclass(frozen=True)
class ServerConfig:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0 picks a free port (see CadenzaServer.port)
    engine: EngineConfig = field(default_factory=EngineConfig)
    limits: Limits = field(default_factory=Limits)  # overrides engine.limits
    drain_grace_s: float = 30.0  # after SIGTERM, open sessions get this long to finish


class CadenzaServer:
    """Owns the engine and the gRPC server. `start()`, then `wait()`; `drain()` on SIGTERM."""

    def __init__(self, config: ServerConfig, extra_servicers: Sequence[AddServicer] = ()) -> None:
        self.config = config
        self.engine = TtsEngine(dataclasses.replace(config.engine, limits=config.limits))
        size = config.limits.max_message_bytes
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", size),
            ("grpc.max_send_message_length", size),
            # No port sharing: a second server on a taken port must fail, not split the traffic.
            ("grpc.so_reuseport", 0),
        ])
        add_native(self.server, self.engine, config.limits.idle_timeout_s)
        add_riva(self.server, self.engine, idle_timeout_s=config.limits.idle_timeout_s)  # same port, same engine
        add_google(self.server, self.engine, idle_timeout_s=config.limits.idle_timeout_s)
        for add in extra_servicers:
            add(self.server, self.engine)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [NATIVE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = 0
        self._stopped = asyncio.Event()

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for service in ("", NATIVE_SERVICE):
            await self.health.set(service, status)

    def bind(self) -> int:
        """Take the listening port (before anything slow): PortInUseError if it is taken."""
        host, port = self.config.host, self.config.port
        check_port_free(host, port)  # a clear error without grpc's own log line, in the usual case
        try:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
            check_port_free(host, port)
            raise OSError(f"cannot listen on {host}:{port} (--host, --port): {exc}") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port} (--host, --port)")
        return self.port

    async def start(self) -> None:
        """Listen at once (health says NOT_SERVING), load + warm up the voice, then SERVING."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if not self.port:
            self.bind()
        await self.server.start()
        await self.engine.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("cadenza serving on port %d", self.port)

    async def drain(self) -> None:
        """No new sessions; open ones get `drain_grace_s` to finish; then stop."""
        log.info("draining: %d open session(s), grace %.0f s", self.engine.live_sessions, self.config.drain_grace_s)
        self.engine.drain()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_grace_s
        while self.engine.live_sessions and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await self.stop()

    async def stop(self) -> None:
        await self.server.stop(grace=1.0)
        if self.engine.ready:  # its thread runs from the end of loading on
            await self.engine.stop()
        self._stopped.set()

    async def abort(self) -> None:
        """Stop after a failed start: no grace, nothing left for the closing event loop."""
        await self.server.stop(grace=None)
        if self.engine.ready:
            await self.engine.stop()
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()


async def serve(config: ServerConfig, extra_servicers: Sequence[AddServicer] = (),
                on_ready: Callable[[CadenzaServer], None] | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain. The port is taken first (PortInUseError before any
    voice loads); a failed start stops the gRPC server and the engine before the error propagates,
    so nothing is left for the event loop to finish after it closes. A signal during start-up
    stops when the current loading step ends (there is nothing to drain); a second one at once."""
    server = CadenzaServer(config, extra_servicers)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    main = asyncio.current_task()
    started = False
    interrupted = False

    def on_signal() -> None:
        nonlocal interrupted
        if started:
            if not tasks:
                tasks.add(loop.create_task(server.drain()))
        elif interrupted:  # a second signal: do not wait for the loading step to end
            log.warning("interrupted again during start-up; quitting at once")
            os._exit(130)
        elif main is not None:
            interrupted = True
            log.info("interrupted during start-up; stopping when the current step ends (again: quit at once)")
            main.cancel()

    try:
        server.bind()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        await server.start()
        started = True
        if on_ready is not None:
            on_ready(server)
        await server.wait()
    except BaseException as exc:
        await server.abort()
        if interrupted and isinstance(exc, asyncio.CancelledError):
            return
        raise
    finally:
        if not interrupted:  # else kept while the loop waits for the loading step: a second signal quits
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
