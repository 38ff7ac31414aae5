"""A session still open when the drain's grace ends is cut with a status that says the server is
shutting down (and how much audio it got), not gRPC's generic cancellation; the server logs what
the drain ended and what it cut (issue 39, item 4)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import grpc

from service.api.client import connect
from service.api.gen.cadenza.v1 import tts_pb2 as pb
from tests.api.compat_server import DATA
from tests.serve_process import start_serve


def test_a_session_open_past_the_drain_grace_is_told_the_server_is_shutting_down() -> None:
    server, port = start_serve("--voices", str(DATA), "--voice", "tiny-multi", "--backend", "torch", "--device",
                               "cpu", "--threads", "1", "--core", "process", "--drain-grace", "1",
                               "--idle-timeout", "120")
    release = threading.Event()
    try:
        channel, stub = connect(f"127.0.0.1:{port}")

        def requests() -> Iterator[pb.StreamingSynthesizeRequest]:
            yield pb.StreamingSynthesizeRequest(config=pb.SessionConfig(seed=1))
            yield pb.StreamingSynthesizeRequest(text="A stream that stays open. ")
            yield pb.StreamingSynthesizeRequest(flush=True)
            release.wait(60)  # never ends its input: the session outlives the grace

        responses = stub.StreamingSynthesize(requests(), timeout=60)
        got = 0.0
        for response in responses:
            if response.HasField("audio"):
                got += response.audio.duration_seconds
                break
        server.send_signal(signal.SIGTERM)
        try:
            for response in responses:
                got += response.audio.duration_seconds
            raise AssertionError("the stream ended without an error")
        except grpc.RpcError as exc:
            error = exc
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        details = error.details() or ""
        assert "shutting down" in details and "reconnect" in details, details
        assert f"{got:.1f} s of audio" in details, (got, details)
        channel.close()
        assert server.wait(timeout=30) == 0
        assert server.stdout is not None
        output = server.stdout.read()
        assert "drained: 0 session(s) ended within the grace, 1 cut at its end" in output, output
        assert "Cancelling all calls" not in output
    finally:
        release.set()
        if server.poll() is None:
            server.kill()
            server.wait()
