"""Several gRPC servers on one port and one event loop (`--accept-servers`): the kernel spreads
connections over them, each serves every API, and the port is still refused to anyone else."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.api.client import stream
from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.api.ports import PortInUseError
from service.api.server import CadenzaServer
from tests.api.native_server import ServerThread
from tests.api.test_native_server import _config

WHICH = "/cadenza.test.Which/Listener"  # answers with the index of the server that took the call


def _number(server: CadenzaServer) -> None:
    """Each of the server's grpc servers answers `WHICH` with its index (added after construction:
    `extra_servicers` are the same for every accept server)."""
    for index, grpc_server in enumerate(server.servers):
        async def answer(request: bytes, context: grpc.aio.ServicerContext, index: int = index) -> bytes:
            return bytes([index])

        grpc_server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "cadenza.test.Which", {"Listener": grpc.unary_unary_rpc_method_handler(answer)}),))


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerThread]:
    s = ServerThread(dataclasses.replace(_config(), accept_servers=3), prepare=_number)
    yield s
    s.close()


def test_connections_spread_over_the_accept_servers_and_each_serves(servers: ServerThread) -> None:
    addr = servers.addr
    # separate connections: grpc shares one subchannel between channels with the same target and arguments
    channels = [grpc.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(12)]
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


def test_the_shared_port_is_refused_to_another_server(servers: ServerThread) -> None:
    async def bind_another() -> None:  # on a running loop, as grpc.aio servers need
        CadenzaServer(dataclasses.replace(_config(), port=servers.server.port, accept_servers=3)).bind()

    with pytest.raises(PortInUseError):
        servers.call(bind_another())


def test_accept_servers_out_of_range_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="--accept-servers"):
        dataclasses.replace(_config(), accept_servers=0)
