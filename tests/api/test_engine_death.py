"""If the engine thread dies, open sessions get an error, health turns NOT_SERVING and the
server stops (issue 12, item 6)."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.api.server import ServerConfig
from service.engine.config import BatchConfig, EngineConfig, Limits
from tests.api.compat_server import DATA
from tests.api.native_server import ServerThread


def test_engine_thread_death_fails_sessions_and_health() -> None:
    server = ServerThread(ServerConfig(
        host="127.0.0.1", port=0, limits=Limits(), drain_grace_s=2.0,
        engine=EngineConfig(voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu", threads=1,
                            batch=BatchConfig(), cache_bytes=0, core="thread"),  # breaks the core in place
    ))
    channel = grpc.insecure_channel(server.addr)
    stub = pb_grpc.TextToSpeechStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    core = server.server.engine.host.core
    started = time.monotonic()
    try:
        def requests():  # type: ignore[no-untyped-def]
            yield pb.StreamingSynthesizeRequest(config=pb.SessionConfig(seed=1))
            yield pb.StreamingSynthesizeRequest(text="Hello there, this stream is open. ")
            time.sleep(0.5)

            def broken(items: object) -> None:  # outside the per-iteration guard
                raise RuntimeError("injected engine failure")

            core._apply = broken  # type: ignore[method-assign]
            yield pb.StreamingSynthesizeRequest(text="The next message reaches a broken engine. ")
            time.sleep(30)  # the stream stays open: the server must end it

        with pytest.raises(grpc.RpcError) as info:
            list(stub.StreamingSynthesize(requests(), timeout=60))
        assert info.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
        assert core.dead.is_set()
        while not server.server.engine_failed and time.monotonic() - started < 20:
            time.sleep(0.05)  # the server's watcher polls every 0.1 s
        assert server.server.engine_failed
        assert time.monotonic() - started < 20
        try:
            status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        except grpc.RpcError as exc:  # or the server has already stopped listening
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        channel.close()
        server.close()
