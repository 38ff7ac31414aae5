"""The unmodified Riva and Google clients against the compatibility servicers on a fake engine.

Checks the wire contract (paths, messages, streaming shapes, errors) independently of the model;
test_riva_compat.py and test_google_compat.py repeat the essentials on the real server.
"""

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
from riva.client.proto.riva_audio_pb2 import AudioEncoding as RivaEncoding

from service.audio.encoding import AudioEncoding
from service.engine.api import SessionConfig
from tests.api.fake_engine import IDLE_TIMEOUT_S, FakeEngine, fake_audio, serve_fake


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def address(engine: FakeEngine) -> Iterator[str]:
    with serve_fake(engine) as addr:
        yield addr


@pytest.fixture()
def tts(address: str) -> riva.client.SpeechSynthesisService:
    return riva.client.SpeechSynthesisService(riva.client.Auth(uri=address, use_ssl=False))


@pytest.fixture()
def google(address: str) -> Iterator[texttospeech.TextToSpeechClient]:
    channel = grpc.insecure_channel(address)
    yield texttospeech.TextToSpeechClient(transport=TextToSpeechGrpcTransport(channel=channel))
    channel.close()


def _expected(text: str, **overrides: object) -> bytes:
    config = SessionConfig(**{"voice": "en_US-joe-medium", "seed": 0, "sample_rate": 22050, **overrides})  # type: ignore[arg-type]
    return b"".join(fake_audio(config, s.strip() + ".") for s in text.split(".") if s.strip())


def test_riva_synthesize(tts: riva.client.SpeechSynthesisService) -> None:
    response = tts.synthesize("Hello there. Bye.", enable_word_time_offsets=True)
    assert response.audio == _expected("Hello there. Bye.")
    assert [w.word for w in response.meta.words] == ["Hello", "Bye."]


def test_riva_synthesize_online_list(tts: riva.client.SpeechSynthesisService, engine: FakeEngine) -> None:
    responses = list(tts.synthesize_online(["One.", "Two. Three."], voice_name="tiny-multi.bob", sample_rate_hz=16000))
    audio = b"".join(r.audio for r in responses)
    expected = _expected("One.", voice="tiny-multi", speaker="bob", sample_rate=16000) + _expected(
        "Two. Three.", voice="tiny-multi", speaker="bob", sample_rate=16000
    )
    assert audio == expected and len(responses) == 3


def test_riva_bad_encoding_is_invalid_argument(tts: riva.client.SpeechSynthesisService) -> None:
    with pytest.raises(grpc.RpcError) as info:
        tts.synthesize("Hi.", encoding=RivaEncoding.OGGOPUS)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "LINEAR_PCM, MULAW, ALAW" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        list(tts.synthesize_online("Hi.", encoding=RivaEncoding.FLAC))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_riva_seed_header(address: str) -> None:
    auth = riva.client.Auth(uri=address, use_ssl=False, metadata_args=[["x-cadenza-seed", "9"]])
    response = riva.client.SpeechSynthesisService(auth).synthesize("Hi.", encoding=RivaEncoding.MULAW)
    assert response.audio == _expected("Hi.", seed=9, encoding=AudioEncoding.MULAW)


def test_google_synthesize_speech(google: texttospeech.TextToSpeechClient) -> None:
    response = google.synthesize_speech(
        input=texttospeech.SynthesisInput(text="Hello."),
        voice=texttospeech.VoiceSelectionParams(language_code="en-US", name="en-US-Cadenza-joe"),
        audio_config=texttospeech.AudioConfig(audio_encoding=texttospeech.AudioEncoding.LINEAR16),
    )
    assert response.audio_content[:4] == b"RIFF"
    assert response.audio_content[44:] == _expected("Hello.", sample_rate=None)


def test_google_streaming(google: texttospeech.TextToSpeechClient) -> None:
    config = texttospeech.StreamingSynthesizeConfig(
        voice=texttospeech.VoiceSelectionParams(language_code="en-US", name="en-US-Cadenza-tiny-multi-alice"),
        streaming_audio_config=texttospeech.StreamingAudioConfig(
            audio_encoding=texttospeech.AudioEncoding.PCM, sample_rate_hertz=16000, speaking_rate=1.5
        ),
    )
    texts = ["Hel", "lo. Go", "od."]
    requests = [texttospeech.StreamingSynthesizeRequest(streaming_config=config)] + [
        texttospeech.StreamingSynthesizeRequest(input=texttospeech.StreamingSynthesisInput(text=t)) for t in texts
    ]
    audio = b"".join(r.audio_content for r in google.streaming_synthesize(iter(requests)))
    assert audio == _expected("Hello. Good.", voice="tiny-multi", speaker="alice", sample_rate=16000, speaking_rate=1.5)


def test_google_streaming_errors_do_not_hang(google: texttospeech.TextToSpeechClient) -> None:
    text = texttospeech.StreamingSynthesizeRequest(input=texttospeech.StreamingSynthesisInput(text="Hi."))
    with pytest.raises(gexc.InvalidArgument, match="streaming_config"):
        list(google.streaming_synthesize(iter([text])))
    config = texttospeech.StreamingSynthesizeRequest(streaming_config=texttospeech.StreamingSynthesizeConfig())
    with pytest.raises(gexc.InvalidArgument, match="first request only"):
        list(google.streaming_synthesize(iter([config, text, config])))
    bad = texttospeech.StreamingSynthesizeRequest(input=texttospeech.StreamingSynthesisInput(text="FAIL"))
    with pytest.raises(gexc.InvalidArgument, match="refuses"):
        list(google.streaming_synthesize(iter([config, bad])))


def test_google_list_voices(google: texttospeech.TextToSpeechClient) -> None:
    names = [v.name for v in google.list_voices(language_code="en-US").voices]
    assert names == [
        "en-US-Cadenza-joe",
        "en-US-Cadenza-tiny-multi",
        "en-US-Cadenza-tiny-multi-alice",
        "en-US-Cadenza-tiny-multi-bob",
    ]


def _stall_after(first: object) -> Iterator[object]:
    yield first
    time.sleep(5 * IDLE_TIMEOUT_S)  # a client that keeps the stream open and sends nothing


def test_idle_streams_are_closed(
    google: texttospeech.TextToSpeechClient, tts: riva.client.SpeechSynthesisService
) -> None:
    config = texttospeech.StreamingSynthesizeRequest(streaming_config=texttospeech.StreamingSynthesizeConfig())
    with pytest.raises(gexc.DeadlineExceeded, match="no message for"):
        list(google.streaming_synthesize(_stall_after(config)))  # type: ignore[arg-type]
    request = rtts.SynthesizeSpeechRequest(text="Hi.", language_code="en-US", sample_rate_hz=22050)
    with pytest.raises(grpc.RpcError) as info:
        list(tts.stub.SynthesizeOnline(_stall_after(request)))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
