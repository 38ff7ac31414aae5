"""Property-based: any sequence of StreamingSynthesize messages on a real server ends with an OK
summary or a clean status, never UNKNOWN/INTERNAL (issue 12, item 7)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.api.server import ServerConfig
from service.engine.config import BatchConfig, EngineConfig, Limits
from tests.api.compat_server import DATA
from tests.api.native_server import ServerThread

CLEAN = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND}

CONFIGS = st.builds(
    pb.SessionConfig,
    seed=st.just(1),
    voice=st.sampled_from(["", "tiny-multi", "no-such-voice", "../etc"]),
    speaker=st.sampled_from(["", "bob", "2", "²", "nobody"]),
    speaking_rate=st.sampled_from([0.0, 1.0, 2.5, -1.0, float("nan")]),
)
TEXTS = st.lists(st.sampled_from(["Hello there. ", "a", ", ", "[T][AH0]", "[Q]", " ", "Dr. Who? "])
                 | st.characters(exclude_categories=["Cs"]), max_size=12).map("".join)
MESSAGES = st.one_of(
    CONFIGS.map(lambda c: pb.StreamingSynthesizeRequest(config=c)),
    TEXTS.map(lambda t: pb.StreamingSynthesizeRequest(text=t)),
    st.just(pb.StreamingSynthesizeRequest(flush=True)),
    st.just(pb.StreamingSynthesizeRequest(end_input=True)),
    st.just(pb.StreamingSynthesizeRequest()),
)


@pytest.fixture(scope="module")
def stub() -> Iterator[pb_grpc.TextToSpeechStub]:
    server = ServerThread(ServerConfig(
        host="127.0.0.1", port=0, drain_grace_s=2.0,
        engine=EngineConfig(limits=Limits(max_text_chars=60),
                            voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu", threads=1,
                            batch=BatchConfig(), cache_bytes=0),
    ))
    channel = grpc.insecure_channel(server.addr)
    yield pb_grpc.TextToSpeechStub(channel)
    channel.close()
    server.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(
    st.lists(MESSAGES, max_size=8),
    # mostly well-formed: a config first, then anything
    st.tuples(CONFIGS, st.lists(MESSAGES, max_size=8)).map(
        lambda t: [pb.StreamingSynthesizeRequest(config=t[0]), *t[1]]),
))
def test_any_message_sequence_ends_cleanly(stub: pb_grpc.TextToSpeechStub,
                                           messages: list[pb.StreamingSynthesizeRequest]) -> None:
    summaries = 0
    try:
        for response in stub.StreamingSynthesize(iter(messages), timeout=60):
            summaries += response.WhichOneof("response") == "summary"
    except grpc.RpcError as exc:
        assert exc.code() in CLEAN, f"{exc.code()}: {exc.details()}"
        assert exc.details() and "<class" not in exc.details()
        return
    assert summaries == (1 if messages else 0)
