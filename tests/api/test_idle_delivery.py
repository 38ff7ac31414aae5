"""The idle timeout counts only while the server has nothing left to send (issue 12, item 4)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.api.server import ServerConfig
from service.engine.config import BatchConfig, EngineConfig, Limits
from tests.api.compat_server import DATA
from tests.api.native_server import ServerThread

IDLE_S = 1.0
SENTENCE = "The quick brown fox jumps over the lazy dog, and everyone watching was happy about it. "


@pytest.fixture(scope="module")
def addr() -> Iterator[str]:
    s = ServerThread(ServerConfig(
        host="127.0.0.1", port=0, drain_grace_s=2.0,
        engine=EngineConfig(limits=Limits(idle_timeout_s=IDLE_S),
                            voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu", threads=1,
                            batch=BatchConfig(), cache_bytes=0),
    ))
    yield s.addr
    s.close()


def test_slow_reader_of_long_audio_is_not_idle(addr: str) -> None:
    """The client sends its text, then only listens (slowly) for longer than the idle limit
    before it sends end_input: audio was being delivered the whole time, so the stream is not cut."""
    quiet_s = 3 * IDLE_S

    def requests() -> Iterator[pb.StreamingSynthesizeRequest]:
        yield pb.StreamingSynthesizeRequest(config=pb.SessionConfig(seed=1, encoding=pb.FLOAT32,
                                                                    sample_rate_hz=48000))
        yield pb.StreamingSynthesizeRequest(text=SENTENCE * 6)
        time.sleep(quiet_s)  # no client message for 3x the idle limit
        yield pb.StreamingSynthesizeRequest(end_input=True)

    channel = grpc.insecure_channel(addr)
    stub = pb_grpc.TextToSpeechStub(channel)
    start = time.monotonic()
    arrivals: list[float] = []
    summary = None
    for response in stub.StreamingSynthesize(requests(), timeout=120):
        if response.WhichOneof("response") == "audio":
            arrivals.append(time.monotonic() - start)
            time.sleep(0.03)  # a slow reader
        elif response.WhichOneof("response") == "summary":
            summary = response.summary
    channel.close()
    print(f"{len(arrivals)} chunks, last at {arrivals[-1]:.2f} s, summary {summary is not None}")
    assert summary is not None and summary.audio_seconds > 0
    assert arrivals[-1] > quiet_s - IDLE_S  # delivery really spanned the idle limit
