"""The grpc.aio server: native servicer, health, reflection, limits and SIGTERM drain."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.api.gen.cadenza.v1 import tts_pb2
from service.api.google_tts import add_google
from service.api.native import add_native
from service.api.riva import add_riva
from service.engine.api import Engine
from service.engine.config import EngineConfig, Limits
from service.engine.engine import TtsEngine

log = logging.getLogger(__name__)

NATIVE_SERVICE = tts_pb2.DESCRIPTOR.services_by_name["TextToSpeech"].full_name
AddServicer = Callable[[grpc.aio.Server, Engine], None]


@dataclass(frozen=True)
class ServerConfig:
    host: str = "[::]"
    port: int = 50051  # 0 picks a free port (see CadenzaServer.port)
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

    async def start(self) -> None:
        """Listen at once (health says NOT_SERVING), load + warm up the voice, then SERVING."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = self.server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {self.config.host}:{self.config.port} (--port)")
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
        await self.engine.stop()
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()


async def serve(config: ServerConfig, extra_servicers: Sequence[AddServicer] = (),
                on_ready: Callable[[CadenzaServer], None] | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain."""
    server = CadenzaServer(config, extra_servicers)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    def on_signal() -> None:
        if not tasks:
            tasks.add(loop.create_task(server.drain()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await server.start()
    if on_ready is not None:
        on_ready(server)
    await server.wait()
