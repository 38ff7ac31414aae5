"""Compatibility streams that go quiet are closed by the real server, never left hanging."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import riva.client
import riva.client.proto.riva_tts_pb2 as rtts
from google.api_core import exceptions as gexc
from google.cloud import texttospeech
from google.cloud.texttospeech_v1.services.text_to_speech.transports import TextToSpeechGrpcTransport

from tests.api.compat_server import running_server

IDLE_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with running_server(idle_timeout_s=IDLE_TIMEOUT_S) as addr:
        yield addr


def _stall_after(first: object) -> Iterator[object]:
    yield first
    time.sleep(5 * IDLE_TIMEOUT_S)  # a client that keeps the stream open and sends nothing


def test_idle_streams_are_closed(address: str) -> None:
    channel = grpc.insecure_channel(address)
    google = texttospeech.TextToSpeechClient(transport=TextToSpeechGrpcTransport(channel=channel))
    config = texttospeech.StreamingSynthesizeRequest(streaming_config=texttospeech.StreamingSynthesizeConfig())
    with pytest.raises(gexc.DeadlineExceeded, match="no message for"):
        list(google.streaming_synthesize(_stall_after(config)))  # type: ignore[arg-type]
    tts = riva.client.SpeechSynthesisService(riva.client.Auth(uri=address, use_ssl=False))
    request = rtts.SynthesizeSpeechRequest(text="Hi.", language_code="en-US", sample_rate_hz=22050)
    with pytest.raises(grpc.RpcError) as info:
        list(tts.stub.SynthesizeOnline(_stall_after(request), timeout=60))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    channel.close()
