"""A CosyVoice2 directory (the random-weight test one: the weights say nothing, so no speech
recognition here) through `cadenza serve --voices <its folder>` in a process of its own and the
unmodified Riva and Google clients: the voice lists show it at 24 kHz with its saved speakers,
each API's audio is the native API's for the same seed, speakers are chosen by name, and what the
family cannot do (a speaking rate, a phoneme dictionary) is refused with what to change."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import riva.client
import riva.client.proto.riva_tts_pb2 as rtts
from google.cloud import texttospeech

from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.audio.encoding import decode_linear16
from tests.api.compat_server import TIMEOUT_S, Native
from tests.serve_process import start_serve, stop_process

VOICE = "cosyvoice2-test"
TEXT = "Thank you for calling. How can I help you today?"
Encoding = texttospeech.AudioEncoding


@pytest.fixture(scope="module")
def address(cosyvoice2_dir: Path) -> Iterator[str]:
    """The server of this module (overrides conftest's, which serves the Piper test voices)."""
    server, port = start_serve("--voices", str(cosyvoice2_dir.parent), "--device", "cpu", "--threads", "2")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(server)


def test_voice_lists_show_the_directory_with_its_speakers(
    address: str, tts: riva.client.SpeechSynthesisService, google: texttospeech.TextToSpeechClient
) -> None:
    with grpc.insecure_channel(address) as channel:
        info = pb_grpc.TextToSpeechStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT_S)
    voice = {v.name: v for v in info.voices}[VOICE]
    assert (voice.family, voice.sample_rate_hz, voice.language) == ("cosyvoice2", 24000, "en-US")
    assert [(s.id, s.name) for s in voice.speakers] == [(0, "prompt_a"), (1, "sft_b")]
    config = tts.stub.GetRivaSynthesisConfig(rtts.RivaSynthesisConfigRequest(), timeout=TIMEOUT_S)
    assert {m.model_name: m.parameters for m in config.model_config}[VOICE]["sample_rate"] == "24000"
    assert f"en-US-Cadenza-{VOICE}" in {v.name for v in google.list_voices(timeout=TIMEOUT_S).voices}


def test_riva_and_google_give_the_native_audio(tts: riva.client.SpeechSynthesisService,
                                               google: texttospeech.TextToSpeechClient, native: Native) -> None:
    want = native.synthesize(TEXT, voice=VOICE)
    assert 1.0 < len(decode_linear16(want)) / 24000 < 30.0
    assert tts.synthesize(TEXT, voice_name=VOICE, language_code="en-US", sample_rate_hz=24000).audio == want
    online = b"".join(r.audio for r in tts.synthesize_online(TEXT, voice_name=VOICE, sample_rate_hz=24000))
    assert online == want
    response = google.synthesize_speech(
        input=texttospeech.SynthesisInput(text=TEXT),
        voice=texttospeech.VoiceSelectionParams(language_code="en-US", name=f"en-US-Cadenza-{VOICE}"),
        audio_config=texttospeech.AudioConfig(audio_encoding=Encoding.PCM), timeout=TIMEOUT_S)
    assert response.audio_content == want


def test_a_speaker_is_chosen_by_name(native: Native) -> None:
    first = native.synthesize(TEXT, voice=VOICE)
    assert native.synthesize(TEXT, voice=VOICE, speaker="prompt_a") == first
    assert native.synthesize(TEXT, voice=VOICE, speaker="sft_b") != first
    with pytest.raises(grpc.RpcError) as caught:
        native.synthesize(TEXT, voice=VOICE, speaker="nobody")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "prompt_a, sft_b" in str(caught.value.details())


@pytest.mark.parametrize(("config", "field", "advice"), [
    ({"speaking_rate": 1.5}, "speaking_rate", "leave speaking_rate at 1.0"),
    ({"custom_dictionary": {"hello": "h@loU"}}, "custom_dictionary", "send no custom dictionary"),
])
def test_what_the_family_cannot_do_is_refused_with_what_to_change(native: Native, config: dict[str, object],
                                                                    field: str, advice: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        native.synthesize(TEXT, voice=VOICE, **config)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in str(caught.value.details()) and advice in str(caught.value.details())
