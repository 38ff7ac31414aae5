"""A real CadenzaServer on a free local port, run on its own event loop thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future

from service.api.server import CadenzaServer, ServerConfig


class ServerThread:
    """`prepare` runs on the server before it starts (on its loop)."""

    def __init__(self, config: ServerConfig, prepare: Callable[[CadenzaServer], None] | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: CadenzaServer = self.call(self._start(config, prepare))
        self.addr = f"127.0.0.1:{self.server.port}"

    def _build(self, config: ServerConfig) -> CadenzaServer:
        return CadenzaServer(config)

    async def _start(self, config: ServerConfig, prepare: Callable[[CadenzaServer], None] | None) -> CadenzaServer:
        server = self._build(config)  # grpc.aio servers bind to the loop they are created on
        if prepare is not None:
            prepare(server)
        await server.start()
        return server

    def call(self, coro, timeout: float = 60):  # type: ignore[no-untyped-def]
        fut: Future[object] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def close(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
