"""Kokoro voices through the unmodified Riva and Google clients, against `cadenza serve --voices
<the Kokoro files>` (README's command) in a process of its own: every voice list shows them with
their gender and 24 kHz, a request naming one (or, Google's way, a language and a gender) gets it,
and what comes back is speech, at 24 kHz, resampled to 16 and 8 kHz, and as G.711 mu-law.

One server for the module; the seeded requests share its result cache, so one voice's sentences
are synthesised once and the other rates and encodings are resampled from them."""

from __future__ import annotations

import io
import wave
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import riva.client
import riva.client.proto.riva_tts_pb2 as rtts
from google.cloud import texttospeech
from riva.client.proto.riva_audio_pb2 import AudioEncoding as RivaEncoding

from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.audio.encoding import decode_linear16, decode_mulaw
from service.models.kokoro import weights as kw
from tests.api.compat_server import TIMEOUT_S, Native
from tests.asr import transcribe
from tests.serve_process import start_serve, stop_process

HEART = "kokoro-af_heart"
TEXT = "Thank you for calling. How can I help you today?"
WORDS = "thank you for calling how can i help you today".split()
Encoding = texttospeech.AudioEncoding
Gender = texttospeech.SsmlVoiceGender


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    """The server of this module (overrides conftest's, which serves the Piper test voices)."""
    home = kw.default_cache_dir()
    kw.fetch_model(home)
    kw.fetch_voices(home)
    server, port = start_serve("--voices", str(home), "--device", "cpu", "--threads", "2")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(server)


def assert_speech(audio: np.ndarray, rate: int) -> None:
    """About TEXT's length at `rate` (3.6 s at the voice's pace), and most of its words recognised."""
    assert 2.5 < len(audio) / rate < 5.0, len(audio) / rate
    hyp = transcribe(audio, rate)
    assert sum(w in hyp for w in WORDS) >= 7, hyp


def test_voice_lists_show_the_kokoro_voices_with_gender_and_24khz(
    address: str, tts: riva.client.SpeechSynthesisService, google: texttospeech.TextToSpeechClient
) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TextToSpeechStub(channel)
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT_S)
        assert list(stub.ListVoices(pb.ListVoicesRequest(), timeout=TIMEOUT_S).voices) == list(info.voices)
    native = {v.name: v for v in info.voices}
    assert sum(v.family == "kokoro" for v in info.voices) == 28  # the English packs: what the frontend speaks
    heart, george = native[HEART], native["kokoro-bm_george"]
    assert (heart.language, heart.gender, heart.sample_rate_hz, heart.family) == ("en-US", pb.FEMALE, 24000, "kokoro")
    assert (george.language, george.gender, george.sample_rate_hz) == ("en-GB", pb.MALE, 24000)
    assert native[info.default_voice].gender == pb.VOICE_GENDER_UNSPECIFIED  # the built-in Piper voice

    config = tts.stub.GetRivaSynthesisConfig(rtts.RivaSynthesisConfigRequest(), timeout=TIMEOUT_S)
    models = {m.model_name: m.parameters for m in config.model_config}
    assert (models[HEART]["language_code"], models[HEART]["sample_rate"], models[HEART]["gender"]) == (
        "en-US", "24000", "female")
    assert models["kokoro-bm_george"]["gender"] == "male"

    british = {v.name: v for v in google.list_voices(language_code="en-GB", timeout=TIMEOUT_S).voices}
    assert "en-GB-Cadenza-kokoro-bm_george" in british and not any(n.startswith("en-US") for n in british)
    george_g = british["en-GB-Cadenza-kokoro-bm_george"]
    assert (george_g.ssml_gender, george_g.natural_sample_rate_hertz, list(george_g.language_codes)) == (
        Gender.MALE, 24000, ["en-GB"])
    heart_g = next(v for v in google.list_voices(language_code="en-US", timeout=TIMEOUT_S).voices
                   if v.name == f"en-US-Cadenza-{HEART}")
    assert heart_g.ssml_gender == Gender.FEMALE
    assert not google.list_voices(language_code="ja", timeout=TIMEOUT_S).voices  # packs the frontend cannot speak


def test_riva_speaks_a_kokoro_voice_at_24k_the_native_audio(
    tts: riva.client.SpeechSynthesisService, native: Native
) -> None:
    audio = tts.synthesize(TEXT, voice_name=HEART, language_code="en-US", sample_rate_hz=24000).audio
    assert audio == native.synthesize(TEXT, voice=HEART)  # 24 kHz: the voice's own rate
    assert_speech(decode_linear16(audio), 24000)


@pytest.mark.parametrize(("rate", "encoding"), [(16000, RivaEncoding.LINEAR_PCM), (8000, RivaEncoding.MULAW)],
                         ids=["16k", "8k-mulaw"])
def test_riva_streams_a_kokoro_voice_resampled(tts: riva.client.SpeechSynthesisService, rate: int,
                                               encoding: int) -> None:
    responses = list(tts.synthesize_online(TEXT, voice_name=HEART, encoding=encoding, sample_rate_hz=rate))
    assert len(responses) > 1  # one utterance after the other
    audio = b"".join(r.audio for r in responses)
    assert_speech(decode_mulaw(audio) if encoding == RivaEncoding.MULAW else decode_linear16(audio), rate)


def test_google_speaks_a_kokoro_voice_by_name(google: texttospeech.TextToSpeechClient) -> None:
    def synthesize(name: str, **audio: object) -> bytes:
        return bytes(google.synthesize_speech(
            input=texttospeech.SynthesisInput(text=TEXT),
            voice=texttospeech.VoiceSelectionParams(language_code="en-US", name=name),
            audio_config=texttospeech.AudioConfig(**audio), timeout=TIMEOUT_S).audio_content)

    with wave.open(io.BytesIO(synthesize(HEART, audio_encoding=Encoding.LINEAR16))) as wav:  # the natural rate
        assert (wav.getframerate(), wav.getsampwidth(), wav.getnchannels()) == (24000, 2, 1)
        assert_speech(decode_linear16(wav.readframes(wav.getnframes())), 24000)
    mulaw = synthesize(f"en-US-Cadenza-{HEART}", audio_encoding=Encoding.MULAW, sample_rate_hertz=8000)
    assert mulaw[:4] == b"RIFF" and int.from_bytes(mulaw[24:28], "little") == 8000
    assert_speech(decode_mulaw(mulaw[mulaw.index(b"data") + 8:]), 8000)

    config = texttospeech.StreamingSynthesizeConfig(
        voice=texttospeech.VoiceSelectionParams(language_code="en-US", name=f"en-US-Cadenza-{HEART}"),
        streaming_audio_config=texttospeech.StreamingAudioConfig(audio_encoding=Encoding.PCM,
                                                                 sample_rate_hertz=16000))
    requests = [texttospeech.StreamingSynthesizeRequest(streaming_config=config),
                *(texttospeech.StreamingSynthesizeRequest(input=texttospeech.StreamingSynthesisInput(text=t))
                  for t in ("Thank you for ", "calling. How can I", " help you today?"))]
    streamed = b"".join(r.audio_content for r in google.streaming_synthesize(iter(requests), timeout=TIMEOUT_S))
    assert_speech(decode_linear16(streamed), 16000)


def test_google_picks_a_kokoro_voice_by_language_and_gender(
    google: texttospeech.TextToSpeechClient, native: Native
) -> None:
    """No name: the first en-GB voice of the preferred gender, as listed (a female one comes first
    by name, and the default voice speaks en-US)."""
    listed = google.list_voices(language_code="en-GB", timeout=TIMEOUT_S).voices
    male = next(v.name for v in listed if v.ssml_gender == Gender.MALE)
    assert listed[0].ssml_gender == Gender.FEMALE
    response = google.synthesize_speech(
        input=texttospeech.SynthesisInput(text="Good morning."),
        voice=texttospeech.VoiceSelectionParams(language_code="en-GB", ssml_gender=Gender.MALE),
        audio_config=texttospeech.AudioConfig(audio_encoding=Encoding.PCM), timeout=TIMEOUT_S)
    assert response.audio_content == native.synthesize("Good morning.", voice=male.removeprefix("en-GB-Cadenza-"))
