"""A real Cadenza server (in a thread, on a free port) and native-API references for the compat tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc

DATA = Path(__file__).resolve().parents[1] / "data"
TINY = "tiny-multi"  # 3 speakers (alice, bob, carol), 16 kHz, in tests/data
TIMEOUT_S = 120.0  # per RPC: a hang fails the test instead of blocking the run


@contextmanager
def running_server(idle_timeout_s: float | None = None) -> Iterator[str]:
    """Start `CadenzaServer` with the test voices; yield "127.0.0.1:<port>"; stop it afterwards."""
    from service.api.server import CadenzaServer, ServerConfig
    from service.engine.config import EngineConfig, Limits

    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict[str, object] = {}

    async def main() -> None:
        try:
            limits = Limits() if idle_timeout_s is None else Limits(idle_timeout_s=idle_timeout_s)
            config = EngineConfig(voices_dir=DATA, limits=limits)
            server = CadenzaServer(ServerConfig(host="127.0.0.1", port=0, engine=config))
            await server.start()
        except BaseException as exc:
            holder["error"] = exc
            started.set()
            raise
        holder["server"] = server
        started.set()
        await server.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    started.wait(300)
    if "error" in holder:
        raise RuntimeError("the server did not start") from holder["error"]  # type: ignore[arg-type]
    server = holder["server"]
    try:
        yield f"127.0.0.1:{server.port}"  # type: ignore[attr-defined]
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(60)  # type: ignore[attr-defined]
        thread.join(60)


class Native:
    """The native API, the reference the compatibility APIs must match byte for byte."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.TextToSpeechStub(self.channel)

    def synthesize(self, text: str, **config: object) -> bytes:
        """Audio bytes of the unary Synthesize RPC (seed 0 unless given, as the compat default)."""
        request = pb.SynthesizeRequest(config=pb.SessionConfig(**{"seed": 0, **config}), text=text)  # type: ignore[arg-type]
        responses = self.stub.Synthesize(request, timeout=TIMEOUT_S)
        return b"".join(r.audio.audio for r in responses if r.WhichOneof("response") == "audio")

    def stream(self, pieces: list[str], **config: object) -> bytes:
        """Audio bytes of a StreamingSynthesize session fed `pieces`, then end of input."""
        first = pb.StreamingSynthesizeRequest(config=pb.SessionConfig(**{"seed": 0, **config}))  # type: ignore[arg-type]
        texts = [pb.StreamingSynthesizeRequest(text=p) for p in pieces]
        requests = [first, *texts, pb.StreamingSynthesizeRequest(end_input=True)]
        responses = self.stub.StreamingSynthesize(iter(requests), timeout=TIMEOUT_S)
        return b"".join(r.audio.audio for r in responses if r.WhichOneof("response") == "audio")

    def close(self) -> None:
        self.channel.close()
