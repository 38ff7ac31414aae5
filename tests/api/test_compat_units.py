"""Pure translation tests for the Riva and Google compatibility layers (no server, no engine)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import riva.client.proto.riva_tts_pb2 as rtts
from google.cloud.texttospeech_v1.types import cloud_tts
from riva.client.proto.riva_audio_pb2 import AudioEncoding as RivaEncoding

from service.api import google_tts, riva
from service.api.compat import (
    check_unary_size,
    language_matches,
    seed_from_metadata,
    spoken_chars,
    voice_for_language,
)
from service.audio.encoding import AudioEncoding
from service.audio.wav import read_wav
from service.engine.contract import (
    Gender,
    InvalidArgument,
    NotFound,
    OutOfRange,
    SpeakerInfo,
    VoiceDescription,
    VoicePrompt,
    WordTiming,
)

JOE = VoiceDescription("en_US-joe-medium", "en-US", 22050, [], loaded=True)
TINY = VoiceDescription(
    "tiny-multi", "en-US", 16000, [SpeakerInfo(0, "alice"), SpeakerInfo(1, "bob"), SpeakerInfo(2, "carol")], False
)
GERMAN = VoiceDescription("de_DE-thorsten-medium", "de-DE", 22050, [], loaded=False)
VOICES = [JOE, TINY, GERMAN]
DEFAULT = JOE.name
# Voices of a family that declares gender (Kokoro's packs), beside the Piper ones that do not.
HEART = VoiceDescription("kokoro-af_heart", "en-US", 24000, [], False, "kokoro", gender=Gender.FEMALE)
MICHAEL = VoiceDescription("kokoro-am_michael", "en-US", 24000, [], False, "kokoro", gender=Gender.MALE)
GEORGE = VoiceDescription("kokoro-bm_george", "en-GB", 24000, [], False, "kokoro", gender=Gender.MALE)
GENDERED = [*VOICES, HEART, MICHAEL, GEORGE]


# --- shared ---------------------------------------------------------------------------------------


def test_seed_header_overrides_default_and_random_means_none() -> None:
    assert seed_from_metadata([], 0) == 0
    assert seed_from_metadata([("x-cadenza-seed", "42")], 0) == 42
    assert seed_from_metadata([("X-Cadenza-Seed", "random")], 0) is None
    with pytest.raises(InvalidArgument, match="x-cadenza-seed"):
        seed_from_metadata([("x-cadenza-seed", "-1")], 0)


def test_spoken_chars_count_what_costs_audio() -> None:
    assert spoken_chars("Hello world") == 11
    assert spoken_chars("a" + "\u0301" * 1000) == 1  # combining marks (Mn)
    assert spoken_chars("a\u20dd\u200b\u200d\u2066b") == 2  # enclosing mark (Me), format characters (Cf)
    assert spoken_chars("a \t\n\u00a0  b") == 3  # a whitespace run is one pause
    assert spoken_chars("in 2023") == 3 + 4 * 3  # digits are read as words
    assert spoken_chars("x" * 1000, stop_after=10) == 11


def test_unary_size_estimate_ignores_silent_marks() -> None:
    def check(text: str) -> None:
        check_unary_size(text, sample_rate=22050, encoding=AudioEncoding.LINEAR16, speaking_rate=1.0,
                         max_message_bytes=4 << 20, extra_bytes=1024, streaming_rpc="SynthesizeOnline")

    check("a" + "\u0301" * 1000)
    check("word " * 150)
    with pytest.raises(OutOfRange, match=r"about 100 s of audio.*SynthesizeOnline"):
        check("abcd " * 200)


def test_language_matching() -> None:
    assert language_matches("en-US", "en-US")
    assert language_matches("en_us", "en-US")
    assert language_matches("en", "en-US")
    assert language_matches("", "en-US")
    assert not language_matches("en-GB", "en-US")
    assert voice_for_language(VOICES, "de-DE", DEFAULT, "f") is GERMAN
    assert voice_for_language(VOICES, "en-US", DEFAULT, "f") is JOE
    with pytest.raises(NotFound, match="fr-FR"):
        voice_for_language(VOICES, "fr-FR", DEFAULT, "f")


def test_a_gender_is_a_preference_within_the_language() -> None:
    assert voice_for_language(GENDERED, "en-US", DEFAULT, "f", Gender.FEMALE) is HEART
    assert voice_for_language(GENDERED, "en-US", DEFAULT, "f", Gender.MALE) is MICHAEL
    assert voice_for_language(GENDERED, "en", DEFAULT, "f", Gender.MALE) is MICHAEL
    assert voice_for_language(GENDERED, "en-GB", DEFAULT, "f", Gender.MALE) is GEORGE
    assert voice_for_language(GENDERED, "en-US", DEFAULT, "f") is JOE  # no preference: the default
    # No voice of that gender speaks it: another voice of the language, not an error.
    assert voice_for_language(GENDERED, "en-GB", DEFAULT, "f", Gender.FEMALE) is GEORGE
    assert voice_for_language(GENDERED, "de-DE", DEFAULT, "f", Gender.FEMALE) is GERMAN


# --- Riva -----------------------------------------------------------------------------------------


def test_riva_custom_dictionary_format() -> None:
    # What riva.client sends for {"NVIDIA": "ˈɛ n ˈv ɪ d i ə", "tomato": "T AH0 M EY1 T OW2"}.
    value = "NVIDIA  ˈɛ n ˈv ɪ d i ə,tomato  T AH0 M EY1 T OW2"
    assert riva.parse_custom_dictionary(value) == {"NVIDIA": "ˈɛnˈvɪdiə", "tomato": "T AH0 M EY1 T OW2"}
    assert riva.parse_custom_dictionary(" , ") == {}
    with pytest.raises(InvalidArgument, match="custom_dictionary"):
        riva.parse_custom_dictionary("lonely")


def test_riva_voice_names() -> None:
    assert riva.resolve_voice("", "en-US", VOICES, DEFAULT) == (JOE, None)
    assert riva.resolve_voice("", "de-DE", VOICES, DEFAULT) == (GERMAN, None)
    assert riva.resolve_voice("tiny-multi.bob", "en-US", VOICES, DEFAULT) == (TINY, "bob")
    assert riva.resolve_voice("tiny-multi", "", VOICES, DEFAULT) == (TINY, None)
    assert riva.resolve_voice("en_US-joe-medium.", "en-US", VOICES, DEFAULT) == (JOE, None)
    with pytest.raises(InvalidArgument, match="language_code"):
        riva.resolve_voice("en_US-joe-medium", "de-DE", VOICES, DEFAULT)
    with pytest.raises(NotFound, match="voice_name"):
        riva.resolve_voice("English-US.Female-1", "en-US", VOICES, DEFAULT)


def test_riva_request_to_session_config() -> None:
    request = rtts.SynthesizeSpeechRequest(
        text="Hello.",
        language_code="en-US",
        encoding=RivaEncoding.ALAW,
        sample_rate_hz=8000,
        voice_name="tiny-multi.alice",
        custom_dictionary="hello  HH AH0 L OW1",
        enable_word_time_offsets=True,
    )
    request.id.value = "req-7"
    request.custom_configuration["speaking_rate"] = "1.5"
    config, voice = riva.session_config(request, VOICES, DEFAULT, seed=0)
    assert voice is TINY
    assert config.voice == "tiny-multi" and config.speaker == "alice"
    assert config.encoding is AudioEncoding.ALAW and config.sample_rate == 8000
    assert config.speaking_rate == 1.5 and config.seed == 0
    assert config.custom_dictionary == {"hello": "HH AH0 L OW1"}
    assert config.word_timings and config.request_id == "req-7"

    request.custom_configuration["seed"] = "random"
    assert riva.session_config(request, VOICES, DEFAULT, seed=0)[0].seed is None


@pytest.mark.parametrize("encoding", [RivaEncoding.FLAC, RivaEncoding.OGGOPUS, 99])
def test_riva_unsupported_encoding_names_the_supported_ones(encoding: int) -> None:
    request = rtts.SynthesizeSpeechRequest(text="x", encoding=encoding)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="LINEAR_PCM, MULAW, ALAW") as info:
        riva.session_config(request, VOICES, DEFAULT, seed=0)
    assert info.value.field == "encoding"


def test_riva_zero_shot_data_becomes_a_voice_prompt() -> None:
    request = rtts.SynthesizeSpeechRequest(text="x")
    request.zero_shot_data.quality = 20
    with pytest.raises(InvalidArgument, match="is empty: send a WAV recording") as info:
        riva.session_config(request, VOICES, DEFAULT, seed=0)
    assert info.value.field == "zero_shot_data.audio_prompt"
    request.zero_shot_data.audio_prompt = b"RIFF...."
    request.zero_shot_data.transcript = "  "
    config, _ = riva.session_config(request, VOICES, DEFAULT, seed=0)
    assert config.voice_prompt == VoicePrompt(b"RIFF....", None)
    pcm = np.arange(-50, 50, dtype="<i2").tobytes() + b"\x01"  # an odd byte at the end is dropped
    for encoding, width in ((RivaEncoding.LINEAR_PCM, 2), (RivaEncoding.MULAW, 1)):
        request.zero_shot_data.audio_prompt = pcm
        request.zero_shot_data.encoding = encoding
        request.zero_shot_data.transcript = "Hello."
        with pytest.raises(InvalidArgument, match="not a WAV file"):  # raw samples need their rate
            riva.session_config(request, VOICES, DEFAULT, seed=0)
        request.zero_shot_data.sample_rate_hz = 16000
        config, _ = riva.session_config(request, VOICES, DEFAULT, seed=0)
        assert config.voice_prompt is not None and config.voice_prompt.transcript == "Hello."
        samples, rate = read_wav(config.voice_prompt.audio)
        assert rate == 16000 and len(samples) == len(pcm) // width
        request.zero_shot_data.sample_rate_hz = 0


def test_riva_rejects_unknown_custom_configuration() -> None:
    request = rtts.SynthesizeSpeechRequest(text="x")
    request.custom_configuration["exaggeration_factor"] = "1.5"
    with pytest.raises(InvalidArgument, match="seed, speaking_rate"):
        riva.session_config(request, VOICES, DEFAULT, seed=0)


def test_riva_word_times_are_milliseconds() -> None:
    words = riva.riva_words([WordTiming("hi", 8000, 16000)], 16000)
    assert (words[0].word, words[0].start_time, words[0].end_time) == ("hi", 500, 1000)


def test_riva_config_lists_voices_and_subvoices() -> None:
    response = riva.config_response(VOICES)
    models = {m.model_name: dict(m.parameters) for m in response.model_config}
    assert models["tiny-multi"]["subvoices"] == "alice:0,bob:1,carol:2"
    assert models["en_US-joe-medium"]["language_code"] == "en-US"
    assert len(riva.config_response(VOICES, "tiny-multi").model_config) == 1
    with pytest.raises(NotFound):
        riva.config_response(VOICES, "nope")


def test_riva_config_names_kokoro_voices_with_their_gender() -> None:
    models = {m.model_name: dict(m.parameters) for m in riva.config_response(GENDERED).model_config}
    assert models["kokoro-af_heart"] == {
        "voice_name": "kokoro-af_heart", "language_code": "en-US", "sample_rate": "24000", "subvoices": "",
        "encodings": "LINEAR_PCM, MULAW, ALAW", "gender": "female"}
    assert models["kokoro-bm_george"]["gender"] == "male" and models["tiny-multi"]["gender"] == "unspecified"
    # talk.py --list-voices offers "<voice_name>.<subvoice>": with no subvoices, "kokoro-af_heart.".
    assert riva.resolve_voice("kokoro-af_heart.", "", GENDERED, DEFAULT) == (HEART, None)
    assert riva.resolve_voice("kokoro-bm_george", "en-GB", GENDERED, DEFAULT) == (GEORGE, None)


# --- Google ---------------------------------------------------------------------------------------


def _voice(name: str = "", language: str = "en-US") -> cloud_tts.VoiceSelectionParams:
    return cloud_tts.VoiceSelectionParams(name=name, language_code=language)


def test_google_voice_names() -> None:
    names = [g.name for g in google_tts.google_voices(VOICES)]
    assert names[:2] == ["en-US-Cadenza-joe", "en-US-Cadenza-tiny-multi"]
    assert "en-US-Cadenza-tiny-multi-bob" in names and "de-DE-Cadenza-thorsten" in names
    pb = cloud_tts.VoiceSelectionParams.pb
    assert google_tts.resolve_voice(pb(_voice("en-US-Cadenza-joe")), VOICES, DEFAULT) == (JOE, None)
    assert google_tts.resolve_voice(pb(_voice("en_US-joe-medium")), VOICES, DEFAULT) == (JOE, None)
    assert google_tts.resolve_voice(pb(_voice("en-US-Cadenza-tiny-multi-bob")), VOICES, DEFAULT) == (TINY, "bob")
    assert google_tts.resolve_voice(pb(_voice("", "de-DE")), VOICES, DEFAULT) == (GERMAN, None)
    with pytest.raises(InvalidArgument, match=r"voice\.language_code"):
        google_tts.resolve_voice(pb(_voice("en-US-Cadenza-joe", "de-DE")), VOICES, DEFAULT)
    with pytest.raises(NotFound, match="en-US-Standard-A"):
        google_tts.resolve_voice(pb(_voice("en-US-Standard-A")), VOICES, DEFAULT)


def _unary(**audio: object) -> object:
    request = cloud_tts.SynthesizeSpeechRequest(
        input=cloud_tts.SynthesisInput(text="Hi."), voice=_voice(), audio_config=cloud_tts.AudioConfig(**audio)
    )
    return cloud_tts.SynthesizeSpeechRequest.pb(request)


def test_google_unary_config() -> None:
    config, text, header, voice = google_tts.unary_session_config(
        _unary(audio_encoding=cloud_tts.AudioEncoding.MULAW, speaking_rate=2.0, sample_rate_hertz=8000),
        VOICES,
        DEFAULT,
        seed=3,
    )
    assert (text, header, voice) == ("Hi.", True, JOE)
    assert config.encoding is AudioEncoding.MULAW and config.sample_rate == 8000
    assert config.speaking_rate == 2.0 and config.seed == 3
    config, _, header, _ = google_tts.unary_session_config(
        _unary(audio_encoding=cloud_tts.AudioEncoding.PCM), VOICES, DEFAULT, seed=None
    )
    assert not header and config.speaking_rate == 1.0 and config.sample_rate is None


@pytest.mark.parametrize(
    ("audio", "field"),
    [
        ({"audio_encoding": cloud_tts.AudioEncoding.MP3}, "audio_config.audio_encoding"),
        ({"speaking_rate": 3.0}, "audio_config.speaking_rate"),
        ({"speaking_rate": 0.1}, "audio_config.speaking_rate"),
        ({"pitch": 2.0}, "audio_config.pitch"),
        ({"volume_gain_db": 1.0}, "audio_config.volume_gain_db"),
    ],
)
def test_google_unary_rejects_unsupported(audio: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        google_tts.unary_session_config(_unary(**audio), VOICES, DEFAULT, seed=0)
    assert info.value.field == field


def test_google_mp3_error_names_supported_encodings() -> None:
    with pytest.raises(InvalidArgument, match="MP3 is not supported; supported encodings: LINEAR16, PCM, MULAW, ALAW"):
        google_tts.unary_session_config(_unary(audio_encoding=cloud_tts.AudioEncoding.MP3), VOICES, DEFAULT, 0)


def test_google_ssml_is_rejected() -> None:
    request = cloud_tts.SynthesizeSpeechRequest(input=cloud_tts.SynthesisInput(ssml="<speak>Hi</speak>"))
    with pytest.raises(InvalidArgument, match=r"input\.ssml"):
        google_tts.unary_session_config(cloud_tts.SynthesizeSpeechRequest.pb(request), VOICES, DEFAULT, 0)


def test_google_ipa_pronunciations_become_dictionary_entries() -> None:
    pron = cloud_tts.CustomPronunciations(
        pronunciations=[
            cloud_tts.CustomPronunciationParams(
                phrase="tomato",
                phonetic_encoding=cloud_tts.CustomPronunciationParams.PhoneticEncoding.PHONETIC_ENCODING_IPA,
                pronunciation="təmˈeɪɾoʊ",
            )
        ]
    )
    streaming = cloud_tts.StreamingSynthesizeConfig(
        voice=_voice("en-US-Cadenza-tiny-multi-carol"),
        streaming_audio_config=cloud_tts.StreamingAudioConfig(
            audio_encoding=cloud_tts.AudioEncoding.LINEAR16, sample_rate_hertz=24000, speaking_rate=0.5
        ),
        custom_pronunciations=pron,
    )
    config = google_tts.streaming_session_config(
        cloud_tts.StreamingSynthesizeConfig.pb(streaming), VOICES, DEFAULT, seed=0
    )
    assert config.custom_dictionary == {"tomato": "[[təmˈeɪɾoʊ]]"}
    assert (config.voice, config.speaker, config.wav_header) == ("tiny-multi", "carol", True)
    assert (config.sample_rate, config.speaking_rate) == (24000, 0.5)


def test_google_unary_wav_header() -> None:
    audio = b"\x01\x02" * 5
    wav = google_tts.wrap_unary_audio(audio, AudioEncoding.LINEAR16, 16000, header=True)
    assert wav[:4] == b"RIFF" and wav[-10:] == audio
    assert struct.unpack("<I", wav[40:44])[0] == 10
    assert google_tts.wrap_unary_audio(audio, AudioEncoding.LINEAR16, 16000, header=False) == audio
    mulaw = google_tts.wrap_unary_audio(b"\xff" * 3, AudioEncoding.MULAW, 8000, header=True)
    assert len(mulaw) % 2 == 0 and mulaw.endswith(b"\xff\xff\xff\x00")


def test_google_list_voices_filters_by_language() -> None:
    response = google_tts.list_voices_response(VOICES, "de")
    assert [v.name for v in response.voices] == ["de-DE-Cadenza-thorsten"]
    assert response.voices[0].natural_sample_rate_hertz == 22050
    assert len(google_tts.list_voices_response(VOICES, "").voices) == 6


def test_google_lists_and_selects_kokoro_voices_by_name_and_gender() -> None:
    Ssml = cloud_tts.SsmlVoiceGender
    listed = {v.name: v for v in google_tts.list_voices_response(GENDERED, "en-US").voices}
    heart = listed["en-US-Cadenza-kokoro-af_heart"]
    assert (list(heart.language_codes), heart.ssml_gender, heart.natural_sample_rate_hertz) == (
        ["en-US"], Ssml.FEMALE, 24000)
    assert listed["en-US-Cadenza-kokoro-am_michael"].ssml_gender == Ssml.MALE
    assert listed["en-US-Cadenza-joe"].ssml_gender == Ssml.SSML_VOICE_GENDER_UNSPECIFIED
    pb = cloud_tts.VoiceSelectionParams.pb

    def select(name: str = "", language: str = "en-US", gender: int = 0) -> object:
        return google_tts.resolve_voice(pb(cloud_tts.VoiceSelectionParams(
            name=name, language_code=language, ssml_gender=gender)), GENDERED, DEFAULT)

    assert select("kokoro-af_heart") == select("en-US-Cadenza-kokoro-af_heart") == (HEART, None)
    assert select(gender=Ssml.FEMALE) == (HEART, None)
    assert select(language="en-GB", gender=Ssml.MALE) == (GEORGE, None)
    assert select(language="en-GB", gender=Ssml.FEMALE) == (GEORGE, None)  # a preference, not a requirement
    assert select(gender=Ssml.NEUTRAL) == (JOE, None)
    assert select("kokoro-am_michael", gender=Ssml.FEMALE) == (MICHAEL, None)  # a name wins over the gender


def test_engine_field_names_are_translated_and_digit_speakers_are_indices() -> None:
    from service.api.compat import renamed, speaker_value

    original = InvalidArgument("config.sample_rate", "4000 Hz is outside 8000..48000")
    error = renamed(original, {"config.sample_rate": "x"})
    assert isinstance(error, InvalidArgument) and error.message == "x: 4000 Hz is outside 8000..48000"
    assert speaker_value("1") == 1 and speaker_value("bob") == "bob" and speaker_value("") is None
    assert riva.resolve_voice("tiny-multi.2", "en-US", VOICES, DEFAULT) == (TINY, 2)
