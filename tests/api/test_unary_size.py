"""Unary Riva and Google synthesis size their refusal by what costs audio, not by characters
(issue 39, item 3), with the unmodified clients against a real server."""

from __future__ import annotations

import grpc
import pytest
import riva.client
from google.api_core import exceptions as gexc
from google.cloud import texttospeech

from tests.api.compat_server import TIMEOUT_S, TINY

MARKS = "a" + "\u0301" * 1000  # one letter, 1000 combining acute accents: well under a second of audio
TOO_LONG = "Plenty of words to read out loud. " * 300  # about 10 000 characters: minutes of audio
RATE = 22050


def _google(client: texttospeech.TextToSpeechClient, text: str) -> bytes:
    response = client.synthesize_speech(
        input=texttospeech.SynthesisInput(text=text),
        voice=texttospeech.VoiceSelectionParams(language_code="en-US", name=f"en-US-Cadenza-{TINY}"),
        audio_config=texttospeech.AudioConfig(audio_encoding=texttospeech.AudioEncoding.LINEAR16,
                                              sample_rate_hertz=RATE),
        timeout=TIMEOUT_S,
    )
    return bytes(response.audio_content)


def test_combining_marks_are_not_counted_as_audio(
    tts: riva.client.SpeechSynthesisService, google: texttospeech.TextToSpeechClient
) -> None:
    audio = tts.synthesize(MARKS, voice_name=TINY, sample_rate_hz=RATE).audio
    assert 0 < len(audio) < 5 * RATE * 2
    assert 44 < len(_google(google, MARKS)) < 5 * RATE * 2 + 44


def test_a_text_too_long_is_still_refused_up_front(
    tts: riva.client.SpeechSynthesisService, google: texttospeech.TextToSpeechClient
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        tts.synthesize(TOO_LONG, voice_name=TINY, sample_rate_hz=RATE)
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "makes about" in info.value.details() and "SynthesizeOnline" in info.value.details()  # before synthesis
    with pytest.raises(gexc.GoogleAPICallError, match=r"makes about .*StreamingSynthesize") as refused:
        _google(google, TOO_LONG)
    assert refused.value.grpc_status_code == grpc.StatusCode.OUT_OF_RANGE
