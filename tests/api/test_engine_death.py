"""If the engine thread dies, open sessions get an error, health turns NOT_SERVING and the
server stops (issue 12, item 6)."""

from __future__ import annotations

import threading
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
        host="127.0.0.1", port=0, drain_grace_s=2.0,
        engine=EngineConfig(limits=Limits(),
                            voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu", threads=1,
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


LONG = " ".join(["This sentence is long enough to keep the decoder busy for a while."] * 12)


def _process_server() -> ServerThread:
    return ServerThread(ServerConfig(
        host="127.0.0.1", port=0, drain_grace_s=2.0,
        engine=EngineConfig(limits=Limits(),
                            voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu", threads=1,
                            batch=BatchConfig(), cache_bytes=0, core="process"),
    ))


def test_a_core_process_that_crashes_is_not_taken_for_one_that_stopped() -> None:
    """The core's main loop failing (here on a message it cannot apply) ends its process as it
    would stop; the server must take it for what it is: open sessions end UNAVAILABLE, new ones
    are refused and the server stops as failed, as when the core process is killed."""
    from service.engine.proc import ProcessHost

    server = _process_server()
    host = server.server.engine.host
    assert isinstance(host, ProcessHost) and host._writer is not None
    channel = grpc.insecure_channel(server.addr)
    stub = pb_grpc.TextToSpeechStub(channel)
    release = threading.Event()
    try:
        def requests():  # type: ignore[no-untyped-def]
            yield pb.StreamingSynthesizeRequest(config=pb.SessionConfig(seed=1))
            yield pb.StreamingSynthesizeRequest(text=LONG)
            release.wait(30)  # the stream stays open: the server must end it

        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            for response in stub.StreamingSynthesize(requests(), timeout=30):
                if response.HasField("audio"):
                    host._writer.put(("batch", None))  # the core's loop cannot iterate that: it crashes
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        assert "reconnect" in (info.value.details() or "")
        assert host.dead.is_set()
        with pytest.raises(grpc.RpcError) as refused:  # refused, or the server has stopped listening
            list(stub.StreamingSynthesize(iter([pb.StreamingSynthesizeRequest(config=pb.SessionConfig(seed=2)),
                                                pb.StreamingSynthesizeRequest(text="Anyone there?"),
                                                pb.StreamingSynthesizeRequest(end_input=True)]), timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        while not server.server.engine_failed and time.monotonic() - started < 20:
            time.sleep(0.05)
        assert server.server.engine_failed
    finally:
        release.set()
        channel.close()
        server.close()


def test_health_says_not_serving_before_any_session_fails_on_core_death() -> None:
    """Killing the core process of a real server (`--core process`): by the time an open session
    sees its error, health already answers NOT_SERVING (no window where a balancer still sends
    new streams to a server whose core is gone)."""
    from service.engine.proc import ProcessHost

    server = _process_server()
    host = server.server.engine.host
    assert isinstance(host, ProcessHost) and host._proc is not None
    channels = [grpc.insecure_channel(server.addr) for _ in range(3)]
    health = health_pb2_grpc.HealthStub(channels[0])
    assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING
    release = threading.Event()
    audio = threading.Barrier(3)
    seen: list[object] = []

    def session(stub: pb_grpc.TextToSpeechStub) -> None:
        def requests():  # type: ignore[no-untyped-def]
            yield pb.StreamingSynthesizeRequest(config=pb.SessionConfig(seed=1))
            yield pb.StreamingSynthesizeRequest(text=LONG)
            release.wait(30)

        first = True
        try:
            for response in stub.StreamingSynthesize(requests(), timeout=30):
                if first and response.HasField("audio"):
                    first = False
                    audio.wait(30)
        except grpc.RpcError as exc:
            try:  # right as the failure arrives
                seen.append(health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status)
            except grpc.RpcError as stopped:  # or the server is already stopping (its calls cut) or stopped
                seen.append(stopped.code())
            seen.append(exc.code())

    threads = [threading.Thread(target=session, args=(pb_grpc.TextToSpeechStub(c),)) for c in channels[1:]]
    try:
        for t in threads:
            t.start()
        audio.wait(30)  # both sessions are streaming
        host._proc.kill()
        for t in threads:
            t.join(30)
        assert len(seen) == 4, seen
        for status in seen[0::2]:
            assert status in (health_pb2.HealthCheckResponse.NOT_SERVING, grpc.StatusCode.UNAVAILABLE,
                              grpc.StatusCode.CANCELLED), seen
    finally:
        release.set()
        for c in channels:
            c.close()
        server.close()
