"""A slow token stream is spoken in sentences, not fragments (issue 33, item 6), on a real server.

The segmenter's timeouts are scaled down with the pace, keeping the pace/timeout ratio of one
character a second against the defaults, so the test takes seconds, not a minute."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import grpc

from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.api.server import ServerConfig
from service.engine.config import BatchConfig, EngineConfig
from service.text.segment import SegmenterConfig
from tests.api.compat_server import DATA
from tests.api.native_server import ServerThread

SCALE = 0.2  # one character every 0.2 s stands for one a second
TEXT = "Hello there, how are you doing today?"


def test_one_character_at_a_time_stays_one_utterance() -> None:
    defaults = SegmenterConfig()
    segmenter = dataclasses.replace(defaults, idle_timeout_s=defaults.idle_timeout_s * SCALE,
                                    word_timeout_s=defaults.word_timeout_s * SCALE)
    server = ServerThread(ServerConfig(
        host="127.0.0.1", port=0, drain_grace_s=2.0,
        engine=EngineConfig(voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu", threads=1,
                            batch=BatchConfig(), cache_bytes=0, segmenter=segmenter),
    ))

    end_sent: list[float] = []

    def requests() -> Iterator[pb.StreamingSynthesizeRequest]:
        yield pb.StreamingSynthesizeRequest(config=pb.SessionConfig(seed=1))
        for ch in TEXT:
            yield pb.StreamingSynthesizeRequest(text=ch)
            time.sleep(SCALE)
        time.sleep(3 * segmenter.word_timeout_s)  # the text is released by the idle timeout, not end_input
        end_sent.append(time.monotonic())
        yield pb.StreamingSynthesizeRequest(end_input=True)

    try:
        channel = grpc.insecure_channel(server.addr)
        responses, first_audio = [], None
        for response in pb_grpc.TextToSpeechStub(channel).StreamingSynthesize(requests(), timeout=60):
            responses.append(response)
            if first_audio is None and response.WhichOneof("response") == "audio":
                first_audio = time.monotonic()
        channel.close()
    finally:
        server.close()
    summary = responses[-1].summary
    assert summary.characters == len(TEXT) and summary.audio_seconds > 0
    assert summary.utterances == 1
    assert first_audio is not None and first_audio < end_sent[0]  # the idle timeout released it
