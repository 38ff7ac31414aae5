"""Several gRPC servers on one port and one event loop (`--accept-servers`): the kernel spreads
connections over them, each serves every API, and the port is still refused to anyone else."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.api.client import stream
from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.api.ports import PortInUseError
from service.api.server import CadenzaServer, ServerConfig
from service.engine.api import Engine
from tests.api.test_native_server import _config

WHICH = "/cadenza.test.Which/Listener"  # answers with the index of the server that took the call


def _which(index: int):  # type: ignore[no-untyped-def]
    def add(server: grpc.aio.Server, engine: Engine) -> None:
        async def answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return bytes([index])

        handler = grpc.method_handlers_generic_handler(
            "cadenza.test.Which", {"Listener": grpc.unary_unary_rpc_method_handler(answer)})
        server.add_generic_rpc_handlers((handler,))
    return add


class _Servers:
    """A CadenzaServer with three accept servers on its own event loop thread; each grpc server
    carries the `Which` method, numbered."""

    def __init__(self, config: ServerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: CadenzaServer = self.call(self._start(config))

    async def _start(self, config: ServerConfig) -> CadenzaServer:
        server = CadenzaServer(config)
        # numbered after construction: `extra_servicers` are the same for every accept server
        for index, grpc_server in enumerate(server.servers):
            _which(index)(grpc_server, server.engine)
        await server.start()
        return server

    def call(self, coro, timeout: float = 60):  # type: ignore[no-untyped-def]
        fut: Future[object] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def close(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def servers() -> Iterator[_Servers]:
    s = _Servers(dataclasses.replace(_config(), accept_servers=3))
    yield s
    s.close()


def test_connections_spread_over_the_accept_servers_and_each_serves(servers: _Servers) -> None:
    addr = f"127.0.0.1:{servers.server.port}"
    # distinct channel arguments: grpc would otherwise share one connection between the channels
    channels = [grpc.insecure_channel(addr, options=[("cadenza.test.channel", k)]) for k in range(12)]
    try:
        seen = {c.unary_unary(WHICH)(b"", timeout=10)[0] for c in channels}
        assert len(seen) > 1, seen  # 12 connections on one of 3 listeners: odds of 3 x 3^-12
        results = [stream(pb_grpc.TextToSpeechStub(c), pb.SessionConfig(seed=1), ["Still here."], timeout=60)
                   for c in channels]
        assert all(r.summary is not None and r.audio == results[0].audio for r in results)
        for c in channels:
            status = health_pb2_grpc.HealthStub(c).Check(health_pb2.HealthCheckRequest(service="")).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for c in channels:
            c.close()


def test_the_shared_port_is_refused_to_another_server(servers: _Servers) -> None:
    other = CadenzaServer(dataclasses.replace(_config(), port=servers.server.port, accept_servers=3))
    with pytest.raises(PortInUseError):
        other.bind()


def test_accept_servers_out_of_range_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="--accept-servers"):
        dataclasses.replace(_config(), accept_servers=0)
