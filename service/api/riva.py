"""NVIDIA Riva TTS (``nvidia.riva.tts.RivaSpeechSynthesis``) on top of Cadenza sessions.

The servicer is built on the message and service classes that ``nvidia-riva-client`` ships, so
the wire format is exactly Riva's. It only translates: requests become a `SessionConfig` plus
text, engine events become ``SynthesizeSpeechResponse`` messages.

Voice names: a Cadenza voice name (``en_US-joe-medium``), optionally with ``.<speaker>`` (name
or index) for a multi-speaker voice, as Riva's ``English-US.Female-1``. Empty: the default voice
if it speaks ``language_code``, else the first voice that does.
"""

from __future__ import annotations

import re
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
import riva.client.proto.riva_tts_pb2 as rtts
import riva.client.proto.riva_tts_pb2_grpc as rtts_grpc
from riva.client.proto.riva_audio_pb2 import AudioEncoding as RivaEncoding

from service.api.compat import (
    DEFAULT_COMPAT_SEED,
    DEFAULT_IDLE_TIMEOUT_S,
    CompatServicer,
    RequestReader,
    check_language,
    check_response_size,
    check_unary_size,
    parse_seed,
    relay_events,
    speaker_value,
    unary_text,
    voice_for_language,
)
from service.api.errors import add_service, methods_of
from service.audio.encoding import AudioEncoding
from service.audio.wav import wav_header
from service.engine.contract import (
    MAX_SPEAKING_RATE,
    MIN_SPEAKING_RATE,
    AudioOut,
    Engine,
    InvalidArgument,
    NotFound,
    SessionConfig,
    VoiceDescription,
    VoicePrompt,
    WordTiming,
    echo,
)

__all__ = [
    "RivaSynthesisServicer",
    "add_riva",
    "config_response",
    "parse_custom_dictionary",
    "resolve_voice",
    "riva_words",
    "session_config",
    "voice_prompt",
]

_ENCODINGS: dict[int, AudioEncoding] = {
    RivaEncoding.ENCODING_UNSPECIFIED: AudioEncoding.LINEAR16,
    RivaEncoding.LINEAR_PCM: AudioEncoding.LINEAR16,
    RivaEncoding.MULAW: AudioEncoding.MULAW,
    RivaEncoding.ALAW: AudioEncoding.ALAW,
}
_SUPPORTED_ENCODINGS = "LINEAR_PCM, MULAW, ALAW"
_CUSTOM_KEYS = ("seed", "speaking_rate")
# Native field names in engine errors -> the Riva request fields that set them.
_FIELDS = {
    "config.encoding": "encoding",
    "config.sample_rate": "sample_rate_hz",
    "config.speaking_rate": "custom_configuration[speaking_rate]",
    "config.seed": "custom_configuration[seed]",
    "config.custom_dictionary": "custom_dictionary",
    "config.language": "language_code",
    "config.voice": "voice_name",
    "config.voice_prompt": "zero_shot_data",
}
RIVA_RPCS = ("Synthesize", "SynthesizeOnline", "GetRivaSynthesisConfig")
_SPACED_ARPABET = re.compile(r"[A-Z]{1,2}[0-2]?(?: [A-Z]{1,2}[0-2]?)*")
_ENTRY_SPLIT = re.compile(r"\s{2,}|\t")


def parse_custom_dictionary(value: str) -> dict[str, str]:
    """Riva's ``"word  phonemes,word2  phonemes2"`` to word -> Cadenza pronunciation.

    Riva separates word and pronunciation by two spaces and IPA phonemes by single spaces;
    space-separated upper-case ARPAbet (``T AH0 M EY1 T OW2``) is kept as is, IPA is joined.
    """
    entries: dict[str, str] = {}
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            continue
        parts = _ENTRY_SPLIT.split(entry, maxsplit=1)
        if len(parts) != 2:
            parts = entry.split(None, 1)
        if len(parts) != 2 or not parts[1].strip():
            raise InvalidArgument(
                "custom_dictionary", f"entry {echo(entry)} is not 'word  pronunciation' (two spaces between them)"
            )
        word, pronunciation = parts[0].strip(), parts[1].strip()
        if not _SPACED_ARPABET.fullmatch(pronunciation):
            pronunciation = "".join(pronunciation.split())
        entries[word] = pronunciation
    return entries


def resolve_voice(
    voice_name: str, language_code: str, voices: Sequence[VoiceDescription], default_voice: str
) -> tuple[VoiceDescription, int | str | None]:
    """The voice (and speaker, if any) a Riva ``voice_name``/``language_code`` pair selects."""
    by_name = {v.name: v for v in voices}
    name = voice_name.strip()
    if not name:
        return voice_for_language(voices, language_code, default_voice, "language_code"), None
    label = ""
    voice = by_name.get(name)
    if voice is None and "." in name:
        base, _, label = name.rpartition(".")  # "voice." (an empty subvoice) means the default speaker
        voice = by_name.get(base)
    if voice is None:
        raise NotFound(f"voice_name: unknown voice {echo(voice_name)}; available: {', '.join(sorted(by_name))}")
    check_language(voice, language_code, "language_code")
    return voice, _speaker(voice, label)


def _speaker(voice: VoiceDescription, label: str) -> int | str | None:
    """The subvoice after the dot: a speaker name or index of `voice`, else NOT_FOUND naming voice_name."""
    speaker = speaker_value(label)
    if speaker is None:
        return None
    names = {s.name for s in voice.speakers if s.name}
    ids = {s.id for s in voice.speakers} or {0}
    if speaker in names or speaker in ids:
        return speaker
    known = ", ".join(f"{s.name or s.id}" for s in voice.speakers) or "none (a single-speaker voice)"
    raise NotFound(f"voice_name: voice {voice.name} has no subvoice {echo(label)}; subvoices: {known}, "
                   "by name or by index in ASCII digits")


def _custom_configuration(values: Mapping[str, str], seed: int | None) -> tuple[int | None, float]:
    """Seed and speaking rate from ``custom_configuration``; other keys are rejected."""
    rate = 1.0
    for key, value in values.items():
        if key == "seed":
            seed = parse_seed(value, "custom_configuration[seed]")
        elif key == "speaking_rate":
            try:
                rate = float(value)
            except ValueError:
                raise InvalidArgument("custom_configuration[speaking_rate]", f"not a number: {echo(value)}") from None
            if not MIN_SPEAKING_RATE <= rate <= MAX_SPEAKING_RATE:
                raise InvalidArgument(
                    "custom_configuration[speaking_rate]",
                    f"must be in {MIN_SPEAKING_RATE}..{MAX_SPEAKING_RATE}, got {rate}",
                )
        else:
            raise InvalidArgument(
                "custom_configuration", f"unknown key {echo(key)}; supported keys: {', '.join(_CUSTOM_KEYS)}"
            )
    return seed, rate


def session_config(
    request: Any, voices: Sequence[VoiceDescription], default_voice: str, seed: int | None
) -> tuple[SessionConfig, VoiceDescription]:
    """A ``SynthesizeSpeechRequest`` as a Cadenza session config (and the voice it picked)."""
    encoding = _ENCODINGS.get(request.encoding)
    if encoding is None:
        name = RivaEncoding.Name(request.encoding) if request.encoding in RivaEncoding.values() else request.encoding
        raise InvalidArgument("encoding", f"{name} is not supported; supported encodings: {_SUPPORTED_ENCODINGS}")
    prompt = voice_prompt(request.zero_shot_data) if request.HasField("zero_shot_data") else None
    voice, speaker = resolve_voice(request.voice_name, request.language_code, voices, default_voice)
    seed, rate = _custom_configuration(dict(request.custom_configuration), seed)
    dictionary = parse_custom_dictionary(request.custom_dictionary) if request.custom_dictionary else None
    config = SessionConfig(
        voice=voice.name,
        speaker=speaker,
        voice_prompt=prompt,
        language=request.language_code or None,
        encoding=encoding,
        sample_rate=request.sample_rate_hz or None,
        speaking_rate=rate,
        seed=seed,
        custom_dictionary=dictionary,
        word_timings=request.enable_word_time_offsets,
        request_id=request.id.value,
    )
    return config, voice


def voice_prompt(data: Any) -> VoicePrompt:
    """``ZeroShotData`` as a voice prompt. Riva's client sends the prompt file's bytes whole (a WAV);
    raw PCM or G.711 with its ``sample_rate_hz`` is given a WAV header. ``quality`` (Magpie's
    setting) has no counterpart here and is not used. No transcript: only the sound is imitated."""
    audio = data.audio_prompt
    if not audio:
        raise InvalidArgument("zero_shot_data.audio_prompt", "is empty: send a WAV recording of the speaker")
    if not audio.startswith(b"RIFF"):
        encoding = _ENCODINGS.get(data.encoding) if data.encoding != RivaEncoding.ENCODING_UNSPECIFIED else None
        if encoding is None or data.sample_rate_hz <= 0:
            raise InvalidArgument("zero_shot_data.audio_prompt", "is not a WAV file: send a WAV recording, or raw "
                                  "LINEAR_PCM, MULAW or ALAW samples with zero_shot_data.encoding and sample_rate_hz")
        samples = len(audio) // encoding.bytes_per_sample
        audio = wav_header(data.sample_rate_hz, encoding, samples) + audio[: samples * encoding.bytes_per_sample]
    return VoicePrompt(audio=audio, transcript=data.transcript.strip() or None)


def riva_words(words: Sequence[WordTiming], sample_rate: int) -> list[Any]:
    """Word timings in output samples to Riva's ``WordTiming`` in milliseconds (as Riva ASR uses)."""
    return [
        rtts.WordTiming(word=w.word, start_time=w.start * 1000 // sample_rate, end_time=w.end * 1000 // sample_rate)
        for w in words
    ]


def config_response(voices: Sequence[VoiceDescription], model_name: str = "") -> Any:
    """``RivaSynthesisConfigResponse``: one model per voice, parameters as Riva's talk.py reads them.
    Riva has no gender field (its voice names carry it, ``English-US.Female-1``): ``gender`` is an
    extra parameter here (female, male or unspecified), which Riva's clients pass over."""
    chosen = [v for v in voices if not model_name or v.name == model_name]
    if model_name and not chosen:
        raise NotFound(f"model_name: unknown voice {echo(model_name)}; available: {', '.join(v.name for v in voices)}")
    response = rtts.RivaSynthesisConfigResponse()
    for voice in chosen:
        model = response.model_config.add(model_name=voice.name)
        model.parameters["voice_name"] = voice.name
        model.parameters["language_code"] = voice.language
        model.parameters["sample_rate"] = str(voice.sample_rate)
        model.parameters["subvoices"] = ",".join(f"{s.name or s.id}:{s.id}" for s in voice.speakers)
        model.parameters["encodings"] = _SUPPORTED_ENCODINGS
        model.parameters["gender"] = voice.gender.value
    return response


class RivaSynthesisServicer(CompatServicer, rtts_grpc.RivaSpeechSynthesisServicer):
    """Riva's three TTS RPCs, each a translation onto `Engine` calls. They run behind
    `service.api.errors.boundary` (see `add_riva`): errors are raised, not caught here."""

    def _config(self, request: Any, context: grpc.aio.ServicerContext) -> tuple[SessionConfig, VoiceDescription]:
        seed = self._seed(context)
        default = self._engine.server_info().default_voice
        return session_config(request, self._engine.voices(), default, seed)

    async def Synthesize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Whole audio for one text in one response (refused up front if it cannot fit in one)."""
        text = unary_text(request.text)
        config, voice = self._config(request, context)
        limit = self._engine.server_info().max_message_bytes
        extra = 2 * len(text.encode()) + (8 * len(text) if config.word_timings else 0) + 1024  # meta, timings
        check_unary_size(text, sample_rate=config.sample_rate or voice.sample_rate, encoding=config.encoding,
                         speaking_rate=config.speaking_rate, max_message_bytes=limit, extra_bytes=extra,
                         streaming_rpc="SynthesizeOnline")
        audio, words, _ = await self._engine.synthesize_all(config, text)
        response = rtts.SynthesizeSpeechResponse(audio=audio)
        response.meta.text = request.text
        response.meta.processed_text = request.text
        if config.word_timings:
            response.meta.words.extend(riva_words(words, config.sample_rate or voice.sample_rate))
        if request.HasField("id"):
            response.id.CopyFrom(request.id)
        check_response_size(response.ByteSize(), limit, "SynthesizeOnline")
        return response

    async def SynthesizeOnline(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """Each request is one utterance, spoken in order; its audio streams back as it is made."""
        requests = RequestReader(request_iterator, self._idle_timeout_s)  # holds no session: its timer lapses
        while True:
            session = None
            try:
                request = await requests.next()
                if request is None:
                    return
                config, _ = self._config(request, context)
                text = unary_text(request.text)
                session = await self._engine.open_session(config)
                session.push_text(text)
                session.end_input()
                async for event in relay_events(session):
                    if not isinstance(event, AudioOut):
                        continue
                    response = rtts.SynthesizeSpeechResponse(audio=event.audio)
                    if config.word_timings and event.words:
                        response.meta.words.extend(riva_words(event.words, event.sample_rate))
                    if request.HasField("id"):
                        response.id.CopyFrom(request.id)
                    yield response
                session = None
            finally:
                if session is not None:
                    session.cancel(sys.exc_info()[1])

    async def GetRivaSynthesisConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """The voices, one Riva "model" each."""
        return config_response(self._engine.voices(), request.model_name)


def add_riva(
    server: grpc.aio.Server,
    engine: Engine,
    default_seed: int | None = DEFAULT_COMPAT_SEED,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    *,
    write_stall_s: float,
) -> None:
    """Serve ``nvidia.riva.tts.RivaSpeechSynthesis`` on `server`."""
    servicer = RivaSynthesisServicer(engine, default_seed, idle_timeout_s)
    service = rtts.DESCRIPTOR.services_by_name["RivaSpeechSynthesis"]
    add_service(server, service.full_name, servicer, methods_of(service), fields=dict.fromkeys(RIVA_RPCS, _FIELDS),
                write_stall_s=write_stall_s)
