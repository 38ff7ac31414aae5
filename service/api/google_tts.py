"""Google Cloud Text-to-Speech (``google.cloud.texttospeech.v1.TextToSpeech``) on Cadenza sessions.

The messages are the protobuf classes behind the proto-plus types of ``google-cloud-texttospeech``
and the handlers are registered under Google's method paths, so the official client works
unchanged. The servicer only translates requests into a `SessionConfig` and events into audio.

Voice names: ``<language>-Cadenza-<short>`` where ``<short>`` is a Piper name without its
language and quality parts (``en_US-joe-medium`` -> ``en-US-Cadenza-joe``) and any other voice's
name as it is (``en-US-Cadenza-kokoro-af_heart``), plus ``-<speaker>`` for a speaker of a
multi-speaker voice. A Cadenza voice name is accepted as is. No name: the default voice if it
speaks ``language_code``, else the first voice that does; ``ssml_gender`` (FEMALE, MALE) is a
preference among those, as Google treats it: a voice of another gender rather than an error.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.cloud.texttospeech_v1.types import cloud_tts

from service.api.compat import (
    DEFAULT_COMPAT_SEED,
    DEFAULT_IDLE_TIMEOUT_S,
    CompatServicer,
    RequestReader,
    check_language,
    check_response_size,
    check_unary_size,
    language_matches,
    relay_events,
    speaker_value,
    unary_text,
    voice_for_language,
)
from service.api.errors import Method, add_service
from service.audio.encoding import AudioEncoding
from service.audio.wav import wav_header
from service.engine.contract import (
    AudioOut,
    Engine,
    Gender,
    InvalidArgument,
    NotFound,
    Session,
    SessionConfig,
    VoiceDescription,
    echo,
)

__all__ = [
    "SERVICE_NAME",
    "GoogleTextToSpeechServicer",
    "GoogleVoice",
    "add_google",
    "google_voices",
    "list_voices_response",
    "resolve_voice",
    "streaming_session_config",
    "unary_session_config",
    "wrap_unary_audio",
]

SERVICE_NAME = "google.cloud.texttospeech.v1.TextToSpeech"

# The wire classes behind the proto-plus wrappers.
ListVoicesRequest: Any = cloud_tts.ListVoicesRequest.pb()
ListVoicesResponse: Any = cloud_tts.ListVoicesResponse.pb()
SynthesizeSpeechRequest: Any = cloud_tts.SynthesizeSpeechRequest.pb()
SynthesizeSpeechResponse: Any = cloud_tts.SynthesizeSpeechResponse.pb()
StreamingSynthesizeRequest: Any = cloud_tts.StreamingSynthesizeRequest.pb()
StreamingSynthesizeResponse: Any = cloud_tts.StreamingSynthesizeResponse.pb()
_GoogleEncoding: Any = cloud_tts.AudioEncoding
_PhoneticEncoding: Any = cloud_tts.CustomPronunciationParams.PhoneticEncoding
_SsmlGender: Any = cloud_tts.SsmlVoiceGender
_GENDERS_OUT = {Gender.FEMALE: _SsmlGender.FEMALE, Gender.MALE: _SsmlGender.MALE,
                Gender.UNSPECIFIED: _SsmlGender.SSML_VOICE_GENDER_UNSPECIFIED}
_GENDERS_IN = {_SsmlGender.FEMALE: Gender.FEMALE, _SsmlGender.MALE: Gender.MALE}  # NEUTRAL: no preference

# The RPCs as Google's service defines them (proto-plus builds no service descriptor to read).
GOOGLE_METHODS = {
    "ListVoices": Method(ListVoicesRequest, ListVoicesResponse, False, False),
    "SynthesizeSpeech": Method(SynthesizeSpeechRequest, SynthesizeSpeechResponse, False, False),
    "StreamingSynthesize": Method(StreamingSynthesizeRequest, StreamingSynthesizeResponse, True, True),
}

MIN_GOOGLE_RATE = 0.25
MAX_GOOGLE_RATE = 2.0
# Native field names in engine errors -> the Google request fields that set them.
_UNARY_FIELDS = {
    "config.encoding": "audio_config.audio_encoding",
    "config.sample_rate": "audio_config.sample_rate_hertz",
    "config.speaking_rate": "audio_config.speaking_rate",
    "config.custom_dictionary": "input.custom_pronunciations",
    "config.language": "voice.language_code",
    "config.voice": "voice.name",
    "text": "input.text",
}
_STREAMING_FIELDS = {
    "config.encoding": "streaming_audio_config.audio_encoding",
    "config.sample_rate": "streaming_audio_config.sample_rate_hertz",
    "config.speaking_rate": "streaming_audio_config.speaking_rate",
    "config.custom_dictionary": "custom_pronunciations",
    "config.language": "voice.language_code",
    "config.voice": "voice.name",
    "text": "input.text",
}
_PIPER_NAME = re.compile(r"[a-z]{2,3}_[A-Z]{2}-(?P<short>.+)-(?:x_low|low|medium|high)")

# Google encoding -> (Cadenza encoding, WAV header). Unary LINEAR16/MULAW/ALAW come as WAV files,
# PCM is headerless; in a stream the header of LINEAR16 has unknown sizes and G.711 is raw.
_UNARY_ENCODINGS: dict[int, tuple[AudioEncoding, bool]] = {
    _GoogleEncoding.AUDIO_ENCODING_UNSPECIFIED: (AudioEncoding.LINEAR16, True),
    _GoogleEncoding.LINEAR16: (AudioEncoding.LINEAR16, True),
    _GoogleEncoding.PCM: (AudioEncoding.LINEAR16, False),
    _GoogleEncoding.MULAW: (AudioEncoding.MULAW, True),
    _GoogleEncoding.ALAW: (AudioEncoding.ALAW, True),
}
_STREAMING_ENCODINGS: dict[int, tuple[AudioEncoding, bool]] = {
    _GoogleEncoding.AUDIO_ENCODING_UNSPECIFIED: (AudioEncoding.LINEAR16, False),
    _GoogleEncoding.PCM: (AudioEncoding.LINEAR16, False),
    _GoogleEncoding.LINEAR16: (AudioEncoding.LINEAR16, True),
    _GoogleEncoding.MULAW: (AudioEncoding.MULAW, False),
    _GoogleEncoding.ALAW: (AudioEncoding.ALAW, False),
}


@dataclass(frozen=True)
class GoogleVoice:
    """One name Google clients can ask for, and the Cadenza voice and speaker behind it."""

    name: str
    voice: VoiceDescription
    speaker: int | str | None


def _short_name(voice_name: str) -> str:
    match = _PIPER_NAME.fullmatch(voice_name)
    return match.group("short") if match else voice_name


def google_voices(voices: Sequence[VoiceDescription]) -> list[GoogleVoice]:
    """Google-style names for every voice, then for every speaker of multi-speaker voices."""
    out: list[GoogleVoice] = []
    seen: set[str] = set()
    for voice in voices:
        base = f"{voice.language}-Cadenza-{_short_name(voice.name)}"
        if base in seen:  # two Piper voices with the same short name: keep the full one
            base = f"{voice.language}-Cadenza-{voice.name}"
        seen.add(base)
        out.append(GoogleVoice(base, voice, None))
        if len(voice.speakers) > 1:
            for speaker in voice.speakers:
                label = speaker.name or str(speaker.id)
                out.append(GoogleVoice(f"{base}-{label}", voice, speaker_value(label)))
    return out


def resolve_voice(
    params: Any, voices: Sequence[VoiceDescription], default_voice: str
) -> tuple[VoiceDescription, int | str | None]:
    """The voice and speaker a ``VoiceSelectionParams`` selects (its language is checked)."""
    for field in ("custom_voice", "voice_clone", "multi_speaker_voice_config"):
        if params.HasField(field):
            raise InvalidArgument(f"voice.{field}", "is not supported by this server")
    if params.model_name:
        raise InvalidArgument("voice.model_name", "is not supported; choose a voice by voice.name")
    if not params.name:
        gender = _GENDERS_IN.get(params.ssml_gender, Gender.UNSPECIFIED)
        return voice_for_language(voices, params.language_code, default_voice, "voice.language_code", gender), None
    by_name = {g.name: g for g in google_voices(voices)}
    by_name.update({v.name: GoogleVoice(v.name, v, None) for v in voices})
    chosen = by_name.get(params.name)
    if chosen is None:
        known = ", ".join(g.name for g in google_voices(voices))
        raise NotFound(f"voice.name: unknown voice {echo(params.name)}; available: {known}")
    check_language(chosen.voice, params.language_code, "voice.language_code")
    return chosen.voice, chosen.speaker


def _speaking_rate(rate: float, field: str) -> float:
    if rate == 0:
        return 1.0
    if not MIN_GOOGLE_RATE <= rate <= MAX_GOOGLE_RATE:
        raise InvalidArgument(field, f"must be in {MIN_GOOGLE_RATE}..{MAX_GOOGLE_RATE} (0 = 1.0), got {rate}")
    return rate


def _encoding(value: int, table: dict[int, tuple[AudioEncoding, bool]], field: str) -> tuple[AudioEncoding, bool]:
    if value not in table:
        name = _GoogleEncoding(value).name if value in {e.value for e in _GoogleEncoding} else str(value)
        supported = ", ".join(_GoogleEncoding(k).name for k in table if k)
        raise InvalidArgument(field, f"{name} is not supported; supported encodings: {supported}")
    return table[value]


def _dictionary(pronunciations: Any, field: str) -> dict[str, str] | None:
    """Google custom pronunciations (IPA only) as a Cadenza custom dictionary."""
    entries: dict[str, str] = {}
    known = {e.value: e.name for e in _PhoneticEncoding}
    for index, item in enumerate(pronunciations.pronunciations):
        if item.phonetic_encoding != _PhoneticEncoding.PHONETIC_ENCODING_IPA:
            name = known.get(item.phonetic_encoding, f"unknown value {item.phonetic_encoding}")
            raise InvalidArgument(f"{field}.pronunciations[{index}].phonetic_encoding",
                                  f"{name} is not supported; use PHONETIC_ENCODING_IPA")
        for part in ("phrase", "pronunciation"):
            if not getattr(item, part).strip():
                raise InvalidArgument(f"{field}.pronunciations[{index}].{part}", "is empty")
        entries[item.phrase] = f"[[{item.pronunciation}]]"
    return entries or None


def unary_session_config(
    request: Any, voices: Sequence[VoiceDescription], default_voice: str, seed: int | None
) -> tuple[SessionConfig, str, bool, VoiceDescription]:
    """A ``SynthesizeSpeechRequest`` as (session config, text, wants a WAV header, voice)."""
    source = request.input.WhichOneof("input_source")
    if source != "text":
        raise InvalidArgument(f"input.{source or 'text'}", "only plain text input (input.text) is supported")
    audio = request.audio_config
    if audio.pitch:
        raise InvalidArgument("audio_config.pitch", "pitch shifting is not supported; leave it 0")
    if audio.volume_gain_db:
        raise InvalidArgument("audio_config.volume_gain_db", "volume gain is not supported; leave it 0")
    if audio.effects_profile_id:
        raise InvalidArgument("audio_config.effects_profile_id", "audio effects profiles are not supported")
    encoding, header = _encoding(audio.audio_encoding, _UNARY_ENCODINGS, "audio_config.audio_encoding")
    voice, speaker = resolve_voice(request.voice, voices, default_voice)
    config = SessionConfig(
        voice=voice.name,
        speaker=speaker,
        language=request.voice.language_code or None,
        encoding=encoding,
        sample_rate=audio.sample_rate_hertz or None,
        speaking_rate=_speaking_rate(audio.speaking_rate, "audio_config.speaking_rate"),
        seed=seed,
        custom_dictionary=_dictionary(request.input.custom_pronunciations, "input.custom_pronunciations"),
    )
    return config, request.input.text, header, voice


def streaming_session_config(
    config: Any, voices: Sequence[VoiceDescription], default_voice: str, seed: int | None
) -> SessionConfig:
    """A ``StreamingSynthesizeConfig`` as a session config (LINEAR16 gets a streaming WAV header)."""
    audio = config.streaming_audio_config
    encoding, header = _encoding(audio.audio_encoding, _STREAMING_ENCODINGS, "streaming_audio_config.audio_encoding")
    voice, speaker = resolve_voice(config.voice, voices, default_voice)
    return SessionConfig(
        voice=voice.name,
        speaker=speaker,
        language=config.voice.language_code or None,
        encoding=encoding,
        sample_rate=audio.sample_rate_hertz or None,
        speaking_rate=_speaking_rate(audio.speaking_rate, "streaming_audio_config.speaking_rate"),
        seed=seed,
        custom_dictionary=_dictionary(config.custom_pronunciations, "custom_pronunciations"),
        wav_header=header,
    )


def wrap_unary_audio(audio: bytes, encoding: AudioEncoding, sample_rate: int, header: bool) -> bytes:
    """Whole-file audio as Google returns it: a complete WAV header for LINEAR16, MULAW, ALAW."""
    if not header:
        return audio
    samples = len(audio) // encoding.bytes_per_sample
    pad = b"\x00" if len(audio) & 1 else b""
    return wav_header(sample_rate, encoding, samples) + audio + pad


def list_voices_response(voices: Sequence[VoiceDescription], language_code: str) -> Any:
    """``ListVoicesResponse`` with the Google-style names, filtered by language if asked."""
    response = ListVoicesResponse()
    for entry in google_voices(voices):
        if language_code and not language_matches(language_code, entry.voice.language):
            continue
        response.voices.add(
            language_codes=[entry.voice.language],
            name=entry.name,
            natural_sample_rate_hertz=entry.voice.sample_rate,
            ssml_gender=_GENDERS_OUT[entry.voice.gender],
        )
    return response


def _input_text(request: Any) -> str:
    kind = request.WhichOneof("streaming_request")
    if kind != "input":
        raise InvalidArgument("streaming_config", "send streaming_config once, in the first request only")
    source = request.input.WhichOneof("input_source")
    if source != "text":
        raise InvalidArgument(f"input.{source or 'text'}", "only plain text input (input.text) is supported")
    return str(request.input.text)


async def _push_inputs(requests: RequestReader[Any], session: Session) -> None:
    """Feed the stream's texts to the session; the client closing its side ends the input."""
    while (request := await requests.next()) is not None:
        session.push_text(_input_text(request))
    session.end_input()


class GoogleTextToSpeechServicer(CompatServicer):
    """Google's three TTS RPCs, each a translation onto `Engine` calls. They run behind
    `service.api.errors.boundary` (see `add_google`): errors are raised, not caught here."""

    async def ListVoices(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Every voice (and speaker) by its Google-style name."""
        return list_voices_response(self._engine.voices(), request.language_code)

    async def SynthesizeSpeech(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Whole audio for one text (refused up front if it cannot fit in one response)."""
        info = self._engine.server_info()
        config, text, header, voice = unary_session_config(
            request, self._engine.voices(), info.default_voice, self._seed(context)
        )
        text = unary_text(text, "input.text")
        rate = config.sample_rate or voice.sample_rate
        limit = info.max_message_bytes
        check_unary_size(text, sample_rate=rate, encoding=config.encoding, speaking_rate=config.speaking_rate,
                         max_message_bytes=limit, extra_bytes=1024, streaming_rpc="StreamingSynthesize")
        audio, _, _ = await self._engine.synthesize_all(config, text)
        response = SynthesizeSpeechResponse(audio_content=wrap_unary_audio(audio, config.encoding, rate, header))
        check_response_size(response.ByteSize(), limit, "StreamingSynthesize")
        return response

    async def StreamingSynthesize(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """First request: streaming_config; then text inputs; audio comes back as it is made."""
        requests = RequestReader(request_iterator, self._idle_timeout_s)
        session: Session | None = None
        reader: asyncio.Task[None] | None = None
        try:
            first = await requests.next()
            if first is None:
                return
            if first.WhichOneof("streaming_request") != "streaming_config":
                raise InvalidArgument("streaming_config", "the first request must carry streaming_config")
            default = self._engine.server_info().default_voice
            config = streaming_session_config(
                first.streaming_config, self._engine.voices(), default, self._seed(context)
            )
            session = requests.session = await self._engine.open_session(config)
            reader = asyncio.create_task(_push_inputs(requests, session))
            async for event in relay_events(session, reader):
                if isinstance(event, AudioOut) and event.audio:
                    yield StreamingSynthesizeResponse(audio_content=event.audio)
            await reader
            session = None
        finally:
            if reader is not None and not reader.done():
                reader.cancel()
            requests.close()
            if session is not None:
                session.cancel(sys.exc_info()[1])


def register_service_descriptor() -> None:
    """Put a descriptor of the Google service in the default pool, so server reflection can
    describe it. google-cloud-texttospeech (proto-plus) registers its messages there but not its
    service: this file declares it, method for method as served (idempotent)."""
    from google.protobuf import descriptor_pb2, descriptor_pool

    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(SERVICE_NAME)
        return
    except KeyError:
        pass
    package, _, name = SERVICE_NAME.rpartition(".")
    proto = descriptor_pb2.FileDescriptorProto(
        name="cadenza/compat/google_cloud_texttospeech_v1_service.proto", package=package, syntax="proto3",
        dependency=[ListVoicesRequest.DESCRIPTOR.file.name])
    service = proto.service.add(name=name)
    for method_name, method in GOOGLE_METHODS.items():
        service.method.add(name=method_name, input_type=f".{method.request.DESCRIPTOR.full_name}",
                           output_type=f".{method.response.DESCRIPTOR.full_name}",
                           client_streaming=method.request_streaming, server_streaming=method.response_streaming)
    pool.Add(proto)


def add_google(
    server: grpc.aio.Server,
    engine: Engine,
    default_seed: int | None = DEFAULT_COMPAT_SEED,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    *,
    write_stall_s: float,
) -> None:
    """Serve ``google.cloud.texttospeech.v1.TextToSpeech`` on `server` under Google's method paths."""
    register_service_descriptor()
    servicer = GoogleTextToSpeechServicer(engine, default_seed, idle_timeout_s)
    add_service(server, SERVICE_NAME, servicer, GOOGLE_METHODS,
                fields={"SynthesizeSpeech": _UNARY_FIELDS, "StreamingSynthesize": _STREAMING_FIELDS},
                write_stall_s=write_stall_s)
