"""The unmodified NVIDIA Riva client against a real Cadenza server: same audio as the native API."""

from __future__ import annotations

import grpc
import pytest
import riva.client
import riva.client.proto.riva_tts_pb2 as rtts
from riva.client.proto.riva_audio_pb2 import AudioEncoding

from tests.api.compat_server import TIMEOUT_S, TINY, Native

TEXT = "Hello there. How are you today?"


def test_synthesize_equals_native(tts: riva.client.SpeechSynthesisService, native: Native) -> None:
    response = tts.synthesize(TEXT, voice_name=f"{TINY}.bob", sample_rate_hz=16000)
    assert len(response.audio) > 16000
    assert response.audio == native.synthesize(TEXT, voice=TINY, speaker="bob", sample_rate_hz=16000)


@pytest.mark.parametrize(
    ("riva_encoding", "native_encoding"), [(AudioEncoding.MULAW, "MULAW"), (AudioEncoding.ALAW, "ALAW")]
)
def test_g711_at_8k_equals_native(
    tts: riva.client.SpeechSynthesisService, native: Native, riva_encoding: int, native_encoding: str
) -> None:
    response = tts.synthesize(TEXT, voice_name=TINY, encoding=riva_encoding, sample_rate_hz=8000)
    assert response.audio == native.synthesize(TEXT, voice=TINY, encoding=native_encoding, sample_rate_hz=8000)


def test_synthesize_online_single_text_and_list(tts: riva.client.SpeechSynthesisService, native: Native) -> None:
    single = list(tts.synthesize_online("Just one sentence.", voice_name=TINY, sample_rate_hz=16000))
    assert len(single) >= 1
    assert b"".join(r.audio for r in single) == native.synthesize("Just one sentence.", voice=TINY)

    texts = ["First request.", "Second request, a little longer than the first."]
    responses = list(tts.synthesize_online(texts, voice_name=f"{TINY}.carol", sample_rate_hz=22050))
    expected = b"".join(native.synthesize(t, voice=TINY, speaker="carol", sample_rate_hz=22050) for t in texts)
    assert b"".join(r.audio for r in responses) == expected


def test_word_time_offsets_fill_meta_words(tts: riva.client.SpeechSynthesisService) -> None:
    response = tts.synthesize(TEXT, voice_name=TINY, sample_rate_hz=16000, enable_word_time_offsets=True)
    words = list(response.meta.words)
    assert [w.word for w in words] == ["Hello", "there", "How", "are", "you", "today"]
    duration_ms = len(response.audio) // 2 * 1000 // 16000
    assert all(0 <= w.start_time < w.end_time <= duration_ms for w in words)
    assert [w.start_time for w in words] == sorted(w.start_time for w in words)
    online = list(tts.synthesize_online([TEXT], voice_name=TINY, sample_rate_hz=16000, enable_word_time_offsets=True))
    assert [w.word for r in online for w in r.meta.words] == [w.word for w in words]


def test_custom_dictionary_changes_the_pronunciation(tts: riva.client.SpeechSynthesisService, native: Native) -> None:
    plain = tts.synthesize("I like tomato.", voice_name=TINY, sample_rate_hz=16000).audio
    custom = tts.synthesize(
        "I like tomato.", voice_name=TINY, sample_rate_hz=16000, custom_dictionary={"tomato": "T AH0 M AA1 T OW2"}
    ).audio
    assert custom != plain
    assert custom == native.synthesize("I like tomato.", voice=TINY, custom_dictionary={"tomato": "T AH0 M AA1 T OW2"})


def test_seed_header_and_request_id(address: str, native: Native) -> None:
    auth = riva.client.Auth(uri=address, use_ssl=False, metadata_args=[["x-cadenza-seed", "7"]])
    seeded = riva.client.SpeechSynthesisService(auth)
    audio = seeded.synthesize(TEXT, voice_name=TINY, sample_rate_hz=16000).audio
    assert audio == native.synthesize(TEXT, voice=TINY, seed=7)
    assert audio != native.synthesize(TEXT, voice=TINY, seed=0)

    request = rtts.SynthesizeSpeechRequest(text="Hi.", voice_name=TINY, language_code="en-US", sample_rate_hz=16000)
    request.id.value = "call-42"
    assert seeded.stub.Synthesize(request, timeout=TIMEOUT_S).id.value == "call-42"
    online = list(seeded.stub.SynthesizeOnline(iter([request]), timeout=TIMEOUT_S))
    assert online and all(r.id.value == "call-42" for r in online)


def test_builtin_voice_by_language(tts: riva.client.SpeechSynthesisService, native: Native) -> None:
    response = tts.synthesize("Good morning.", language_code="en-US")  # client default: 22050 Hz LINEAR_PCM
    assert response.audio == native.synthesize("Good morning.", sample_rate_hz=22050)


def test_get_riva_synthesis_config(tts: riva.client.SpeechSynthesisService) -> None:
    response = tts.stub.GetRivaSynthesisConfig(rtts.RivaSynthesisConfigRequest(), timeout=TIMEOUT_S)
    models = {m.model_name: m.parameters for m in response.model_config}
    assert models[TINY]["subvoices"] == "alice:0,bob:1,carol:2"
    assert models[TINY]["language_code"] == "en-US" and models[TINY]["sample_rate"] == "16000"
    assert "en_US-joe-medium" in models


@pytest.mark.parametrize(
    ("kwargs", "code", "needle"),
    [
        ({"encoding": AudioEncoding.OGGOPUS}, grpc.StatusCode.INVALID_ARGUMENT, "LINEAR_PCM, MULAW, ALAW"),
        ({"encoding": AudioEncoding.FLAC}, grpc.StatusCode.INVALID_ARGUMENT, "FLAC is not supported"),
        ({"voice_name": "English-US.Female-1"}, grpc.StatusCode.NOT_FOUND, "voice_name"),
        ({"voice_name": TINY, "language_code": "de-DE"}, grpc.StatusCode.INVALID_ARGUMENT, "language_code"),
        ({"voice_name": TINY, "sample_rate_hz": 4000}, grpc.StatusCode.INVALID_ARGUMENT, "sample_rate_hz"),
        ({"voice_name": f"{TINY}.dave"}, grpc.StatusCode.NOT_FOUND, "dave"),
        ({"custom_configuration": {"pitch": "2"}}, grpc.StatusCode.INVALID_ARGUMENT, "custom_configuration"),
    ],
)
def test_bad_requests_fail_clearly_both_ways(
    tts: riva.client.SpeechSynthesisService, kwargs: dict[str, object], code: grpc.StatusCode, needle: str
) -> None:
    with pytest.raises(grpc.RpcError) as unary:
        tts.synthesize("Hi.", **kwargs)  # type: ignore[arg-type]
    assert unary.value.code() == code and needle in unary.value.details()
    with pytest.raises(grpc.RpcError) as online:
        list(tts.synthesize_online(["Hi.", "Again."], **kwargs))  # type: ignore[arg-type]
    assert online.value.code() == code and needle in online.value.details()
