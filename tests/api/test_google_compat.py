"""The unmodified Google Cloud TTS client against a real Cadenza server: same audio as the native API."""

from __future__ import annotations

import io
import wave
from collections.abc import Iterator

import grpc
import pytest
from google.api_core import exceptions as gexc
from google.cloud import texttospeech
from google.cloud.texttospeech_v1.services.text_to_speech.transports import TextToSpeechGrpcTransport

from tests.api.compat_server import TIMEOUT_S, TINY, Native

TEXT = "Hello there. How are you today?"
Encoding = texttospeech.AudioEncoding


@pytest.fixture(scope="module")
def client(address: str) -> Iterator[texttospeech.TextToSpeechClient]:
    channel = grpc.insecure_channel(address)
    yield texttospeech.TextToSpeechClient(transport=TextToSpeechGrpcTransport(channel=channel))
    channel.close()


def _synthesize(
    client: texttospeech.TextToSpeechClient,
    text: str = TEXT,
    name: str = "en-US-Cadenza-tiny-multi-bob",
    **audio: object,
) -> bytes:
    response = client.synthesize_speech(
        input=texttospeech.SynthesisInput(text=text),
        voice=texttospeech.VoiceSelectionParams(language_code="en-US", name=name),
        audio_config=texttospeech.AudioConfig(**audio),
        timeout=TIMEOUT_S,
    )
    return bytes(response.audio_content)


def test_synthesize_speech_linear16_is_a_wav_of_the_native_audio(
    client: texttospeech.TextToSpeechClient, native: Native
) -> None:
    audio = _synthesize(client, audio_encoding=Encoding.LINEAR16, speaking_rate=1.25)
    with wave.open(io.BytesIO(audio)) as wav:
        assert (wav.getframerate(), wav.getsampwidth(), wav.getnchannels()) == (16000, 2, 1)
        frames = wav.readframes(wav.getnframes())
    assert frames == native.synthesize(TEXT, voice=TINY, speaker="bob", speaking_rate=1.25)


@pytest.mark.parametrize(("encoding", "native_encoding"), [(Encoding.MULAW, "MULAW"), (Encoding.ALAW, "ALAW")])
def test_synthesize_speech_g711(
    client: texttospeech.TextToSpeechClient, native: Native, encoding: int, native_encoding: str
) -> None:
    audio = _synthesize(client, audio_encoding=encoding, sample_rate_hertz=8000)
    assert audio[:4] == b"RIFF" and audio[8:12] == b"WAVE"
    expected = native.synthesize(TEXT, voice=TINY, speaker="bob", encoding=native_encoding, sample_rate_hz=8000)
    data_at = audio.index(b"data") + 8
    assert audio[data_at : data_at + len(expected)] == expected


def test_synthesize_speech_pcm_is_headerless_and_piper_names_work(
    client: texttospeech.TextToSpeechClient, native: Native
) -> None:
    audio = _synthesize(client, name=TINY, audio_encoding=Encoding.PCM, sample_rate_hertz=24000)
    assert audio == native.synthesize(TEXT, voice=TINY, sample_rate_hz=24000)


def test_builtin_voice_by_language(client: texttospeech.TextToSpeechClient, native: Native) -> None:
    audio = _synthesize(client, "Good morning.", name="", audio_encoding=Encoding.PCM)
    assert audio == native.synthesize("Good morning.")


def _streaming_requests(
    pieces: list[str], encoding: int = Encoding.PCM, **audio: object
) -> Iterator[texttospeech.StreamingSynthesizeRequest]:
    config = texttospeech.StreamingSynthesizeConfig(
        voice=texttospeech.VoiceSelectionParams(language_code="en-US", name="en-US-Cadenza-tiny-multi-alice"),
        streaming_audio_config=texttospeech.StreamingAudioConfig(audio_encoding=encoding, **audio),
    )
    yield texttospeech.StreamingSynthesizeRequest(streaming_config=config)
    for piece in pieces:
        yield texttospeech.StreamingSynthesizeRequest(input=texttospeech.StreamingSynthesisInput(text=piece))


def test_streaming_synthesize_equals_native_stream(client: texttospeech.TextToSpeechClient, native: Native) -> None:
    pieces = ["Hel", "lo there. ", "How are", " you today?"]
    responses = list(
        client.streaming_synthesize(
            _streaming_requests(pieces, speaking_rate=0.8, sample_rate_hertz=22050), timeout=TIMEOUT_S
        )
    )
    assert len(responses) > 1
    audio = b"".join(r.audio_content for r in responses)
    assert audio == native.stream(pieces, voice=TINY, speaker="alice", speaking_rate=0.8, sample_rate_hz=22050)


@pytest.mark.parametrize(("encoding", "native_encoding"), [(Encoding.MULAW, "MULAW"), (Encoding.ALAW, "ALAW")])
def test_streaming_g711(
    client: texttospeech.TextToSpeechClient, native: Native, encoding: int, native_encoding: str
) -> None:
    responses = client.streaming_synthesize(
        _streaming_requests([TEXT], encoding=encoding, sample_rate_hertz=8000), timeout=TIMEOUT_S
    )
    audio = b"".join(r.audio_content for r in responses)
    assert audio == native.stream([TEXT], voice=TINY, speaker="alice", encoding=native_encoding, sample_rate_hz=8000)


def test_list_voices(client: texttospeech.TextToSpeechClient) -> None:
    voices = {v.name: v for v in client.list_voices(language_code="en-US", timeout=TIMEOUT_S).voices}
    assert {"en-US-Cadenza-joe", "en-US-Cadenza-tiny-multi", "en-US-Cadenza-tiny-multi-carol"} <= set(voices)
    assert voices["en-US-Cadenza-tiny-multi"].natural_sample_rate_hertz == 16000
    assert list(voices["en-US-Cadenza-joe"].language_codes) == ["en-US"]
    assert not client.list_voices(language_code="fr-FR", timeout=TIMEOUT_S).voices


@pytest.mark.parametrize(
    ("audio", "error", "needle"),
    [
        ({"audio_encoding": Encoding.MP3}, gexc.InvalidArgument, "LINEAR16, PCM, MULAW, ALAW"),
        ({"speaking_rate": 3.0}, gexc.InvalidArgument, "0.25..2.0"),
        ({"pitch": 4.0}, gexc.InvalidArgument, "pitch"),
        ({"sample_rate_hertz": 4000}, gexc.InvalidArgument, "audio_config.sample_rate_hertz"),
    ],
)
def test_synthesize_speech_rejects_unsupported(
    client: texttospeech.TextToSpeechClient, audio: dict[str, object], error: type[Exception], needle: str
) -> None:
    with pytest.raises(error, match=needle):
        _synthesize(client, **audio)


def test_unknown_voice_and_language_mismatch(client: texttospeech.TextToSpeechClient) -> None:
    with pytest.raises(gexc.NotFound, match="en-US-Wavenet-D"):
        _synthesize(client, name="en-US-Wavenet-D")
    with pytest.raises(gexc.InvalidArgument, match="language_code"):
        client.synthesize_speech(
            input=texttospeech.SynthesisInput(text="Hi."),
            voice=texttospeech.VoiceSelectionParams(language_code="de-DE", name="en-US-Cadenza-joe"),
            audio_config=texttospeech.AudioConfig(),
            timeout=TIMEOUT_S,
        )
    with pytest.raises(gexc.InvalidArgument, match="ssml"):
        client.synthesize_speech(
            input=texttospeech.SynthesisInput(ssml="<speak>Hi.</speak>"),
            voice=texttospeech.VoiceSelectionParams(language_code="en-US"),
            audio_config=texttospeech.AudioConfig(),
            timeout=TIMEOUT_S,
        )


def test_streaming_errors_end_the_stream(client: texttospeech.TextToSpeechClient) -> None:
    text_first = [texttospeech.StreamingSynthesizeRequest(input=texttospeech.StreamingSynthesisInput(text="Hi."))]
    with pytest.raises(gexc.InvalidArgument, match="streaming_config"):
        list(client.streaming_synthesize(iter(text_first), timeout=TIMEOUT_S))
    with pytest.raises(gexc.InvalidArgument, match="OGG_OPUS"):
        list(client.streaming_synthesize(_streaming_requests(["Hi."], encoding=Encoding.OGG_OPUS), timeout=TIMEOUT_S))
    with pytest.raises(gexc.InvalidArgument, match="speaking_rate"):
        list(client.streaming_synthesize(_streaming_requests(["Hi."], speaking_rate=0.1), timeout=TIMEOUT_S))
    # A second config mid-stream, while audio for the first text is being made.
    requests = [*_streaming_requests([TEXT]), next(_streaming_requests([]))]
    with pytest.raises(gexc.InvalidArgument, match="first request only"):
        list(client.streaming_synthesize(iter(requests), timeout=TIMEOUT_S))


def test_seed_metadata(client: texttospeech.TextToSpeechClient, native: Native) -> None:
    response = client.synthesize_speech(
        input=texttospeech.SynthesisInput(text=TEXT),
        voice=texttospeech.VoiceSelectionParams(language_code="en-US", name=TINY),
        audio_config=texttospeech.AudioConfig(audio_encoding=Encoding.PCM),
        metadata=[("x-cadenza-seed", "11")],
        timeout=TIMEOUT_S,
    )
    assert response.audio_content == native.synthesize(TEXT, voice=TINY, seed=11)
    assert response.audio_content != native.synthesize(TEXT, voice=TINY, seed=0)


def test_reflection_describes_the_google_service(address: str) -> None:
    """Server reflection (what grpcurl and Postman use) lists and describes the Google service,
    its methods with their streaming shapes and message types."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    service = "google.cloud.texttospeech.v1.TextToSpeech"
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = [reflection_pb2.ServerReflectionRequest(list_services=""),
               reflection_pb2.ServerReflectionRequest(file_containing_symbol=service)]
        listed, described = list(stub.ServerReflectionInfo(iter(ask), timeout=TIMEOUT_S))
    assert service in {s.name for s in listed.list_services_response.service}
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in described.file_descriptor_response.file_descriptor_proto]
    methods = {m.name: m for f in files for s in f.service if f"{f.package}.{s.name}" == service for m in s.method}
    assert set(methods) == {"ListVoices", "SynthesizeSpeech", "StreamingSynthesize"}
    assert methods["StreamingSynthesize"].client_streaming and methods["StreamingSynthesize"].server_streaming
    assert methods["SynthesizeSpeech"].input_type == ".google.cloud.texttospeech.v1.SynthesizeSpeechRequest"
    messages = {f"{f.package}.{m.name}" for f in files for m in f.message_type}
    assert "google.cloud.texttospeech.v1.SynthesizeSpeechRequest" in messages  # its dependency came along
