"""The engine's domain contract: what every servicer (native, Riva, Google) calls.

Servicers translate their protos into a `SessionConfig`, open a `Session`, push text and
relay `AudioOut` events; they never touch the model. Errors are typed so one place can map
them to gRPC status codes with messages that say what to change.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from service.audio.encoding import AudioEncoding
from service.models.family import Gender, OptionSpec, WordTiming

__all__ = [
    "MAX_ECHO_CHARS",
    "MAX_SAMPLE_RATE",
    "MAX_SPEAKING_RATE",
    "MIN_SAMPLE_RATE",
    "MIN_SPEAKING_RATE",
    "AudioOut",
    "ClientStalled",
    "Engine",
    "EngineError",
    "FailedPrecondition",
    "Gender",
    "InvalidArgument",
    "NotFound",
    "OutOfRange",
    "Precision",
    "ResourceExhausted",
    "ServerInfo",
    "Session",
    "SessionConfig",
    "SessionEvent",
    "SessionSummary",
    "SpeakerInfo",
    "Unavailable",
    "VoiceDescription",
    "VoicePrompt",
    "WordTiming",
    "check_text",
    "echo",
]

MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 48000
MIN_SPEAKING_RATE = 0.25
MAX_SPEAKING_RATE = 4.0
MAX_ECHO_CHARS = 80  # client input quoted in an error message is cut to this many characters
ENGINE_DIED = "the engine thread died; see the server log"  # what the sessions it leaves end with


def echo(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """Client input as an error message quotes it: repr, cut to `limit` characters with an ellipsis
    (a 10 000-character language code must not come back whole)."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


class Precision(enum.Enum):
    """Numeric precision a session asks for; AUTO lets the server decide per session."""

    AUTO = "auto"
    FP16 = "fp16"
    FP32 = "fp32"
    INT8 = "int8"  # CPU, where the server was started with --int8 (lossy)


@dataclass(frozen=True)
class VoicePrompt:
    """A recording of the speaker a session should sound like (zero-shot), for voices that take one
    (`VoiceDescription.voice_prompts`): a WAV file's bytes and, when known, the words spoken in it."""

    audio: bytes
    transcript: str | None = None


@dataclass(frozen=True)
class SessionConfig:
    """One stream's settings, fixed for its lifetime. None means "the voice's/server's default"."""

    voice: str | None = None
    speaker: int | str | None = None
    voice_prompt: VoicePrompt | None = None  # speak like this recording (instead of a speaker)
    language: str | None = None  # checked against the voice's language when given
    encoding: AudioEncoding = AudioEncoding.LINEAR16
    sample_rate: int | None = None  # output rate, 8000..48000; None = the voice's rate
    speaking_rate: float = 1.0  # length_scale = voice default / rate; 0.25..4.0
    options: Mapping[str, float] | None = None  # the voice's model-family options by name (VoiceDescription.options)
    seed: int | None = None  # given: reproducible audio (and cacheable); None: random
    precision: Precision = Precision.AUTO
    first_chunk_frames: int | None = None  # decoder frames in an utterance's first chunk
    max_chunk_frames: int | None = None  # cap on later chunks
    custom_dictionary: Mapping[str, str] | None = None  # word -> pronunciation annotation
    wav_header: bool = False  # prepend a streaming WAV header to the first audio bytes
    word_timings: bool = False  # attach word timings to audio events
    request_id: str = ""  # echoed in logs for tracing


@dataclass(frozen=True)
class AudioOut:
    """One encoded audio chunk for the client."""

    audio: bytes  # encoded at `sample_rate` (WAV header on the first chunk if asked)
    seq: int  # 0, 1, 2, ... within the session
    offset_samples: int  # stream position of the first sample, at the output rate
    num_samples: int
    sample_rate: int
    utterance: int  # index of the utterance this chunk belongs to (-1: resampler tail)
    precision: Precision  # FP16, FP32 or INT8: what actually produced the chunk
    fallback: bool  # the NaN/Inf guard tripped and the chunk was recomputed in FP32
    words: list[WordTiming] = field(default_factory=list)  # output-rate samples from stream start


@dataclass(frozen=True)
class SessionSummary:
    """Sent once when a session ends normally."""

    characters: int  # characters accepted and spoken
    audio_seconds: float
    ttfa_seconds: float | None  # first text received -> first audio event ready; None if no audio
    fallbacks: int  # chunks recomputed in FP32
    utterances: int
    chunks: int
    cache_hits: int = 0  # utterances served from the result cache
    precision: Precision = Precision.FP32  # what AUTO resolved to (or what was asked)
    precision_reason: str = ""  # why: requested, hardware, load or the voice's guard-trip history


SessionEvent = AudioOut | SessionSummary


class EngineError(Exception):
    """Base for errors a client caused or must react to; the message says what to change."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[object, ...]:
        """Picklable whatever a subclass's constructor takes: errors cross from an engine core
        in its own process to the server."""
        return _rebuild_error, (type(self), self.message, dict(vars(self)))


def _rebuild_error(cls: type[EngineError], message: str, state: dict[str, object]) -> EngineError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.__dict__.update(state)
    return exc


class InvalidArgument(EngineError):
    """A request field has a bad value; `field` names it (e.g. "config.sample_rate")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFound(EngineError):
    """Unknown voice or speaker."""


class ResourceExhausted(EngineError):
    """Too many sessions, too much text: try later or send less."""


class OutOfRange(EngineError):
    """The request is valid but too large for this RPC (e.g. a unary response message): use another."""


class ClientStalled(EngineError):
    """The client stopped taking audio for longer than the server waits (gRPC DEADLINE_EXCEEDED)."""


class FailedPrecondition(EngineError):
    """The request is valid but the server cannot take it now (draining, not ready, closed session)."""


class Unavailable(FailedPrecondition):
    """The server is loading or draining: retry, possibly on another instance (gRPC UNAVAILABLE)."""


@dataclass(frozen=True)
class SpeakerInfo:
    id: int
    name: str


@dataclass(frozen=True)
class VoiceDescription:
    """What a client needs to choose a voice."""

    name: str
    language: str
    sample_rate: int
    speakers: list[SpeakerInfo]
    loaded: bool  # weights in memory now (first session on an unloaded voice pays the load)
    family: str = ""  # its model family (a `service.models.registry` name)
    options: tuple[OptionSpec, ...] = ()  # what SessionConfig.options may set
    gender: Gender = Gender.UNSPECIFIED  # as its family declares it (voice lists; Google's ssml_gender)
    voice_prompts: bool = False  # a session may give a recording to sound like (SessionConfig.voice_prompt)


@dataclass(frozen=True)
class ServerInfo:
    backend: str
    device: str
    precisions: list[Precision]  # what this backend can run
    default_voice: str
    fp32_pins: list[str]  # modules kept in FP32 when running FP16
    versions: Mapping[str, str]  # package -> version
    capacity_streams: float | None = None  # real-time streams the server estimates it carries
    open_sessions: int = 0
    max_message_bytes: int = 4 << 20  # the largest gRPC message either way (a unary response must fit)


def check_text(text: str, field: str = "text") -> None:
    """Reject text no voice can speak as sent: a NUL character (U+0000)."""
    if "\x00" in text:
        raise InvalidArgument(field, "contains a NUL character (U+0000); remove it")


class Session(Protocol):
    """One stream: text in (any deltas), audio events out, in order."""

    def push_text(self, delta: str) -> None:
        """Add text; raises ResourceExhausted past the per-session text limit,
        FailedPrecondition after end_input/cancel."""
        ...

    def flush(self) -> None:
        """Speak everything buffered now, without waiting for a sentence end."""
        ...

    def end_input(self) -> None:
        """No more text: speak the rest, then `events()` ends with a SessionSummary."""
        ...

    def cancel(self, error: BaseException | None = None) -> None:
        """Stop now: drop queued work (in-flight work ends within one chunk) and free the session.
        `error`: what ended the call early, if anything (the session's status in logs and traces)."""
        ...

    def events(self) -> AsyncIterator[SessionEvent]:
        """AudioOut events in order, then one SessionSummary (unless cancelled)."""
        ...

    def interrupt(self, error: BaseException) -> None:
        """Make `events()` raise `error` now, ahead of any audio still queued (the request side
        failed: a bad message must not wait behind audio)."""
        ...

    def quiet_s(self, now: float) -> float:
        """Seconds (on `time.monotonic`) the server has had nothing to send: 0 while audio is
        queued for the client or being written to it. Idle timeouts count only this time."""
        ...


class Engine(Protocol):
    """Owns the model(s) and the engine thread; creates sessions."""

    async def open_session(self, config: SessionConfig) -> Session:
        """Validate `config` and start a session; raises InvalidArgument, NotFound,
        ResourceExhausted or FailedPrecondition."""
        ...

    def voices(self) -> list[VoiceDescription]: ...

    def server_info(self) -> ServerInfo: ...

    async def synthesize_all(
        self, config: SessionConfig, text: str
    ) -> tuple[bytes, list[WordTiming], SessionSummary]:
        """Whole text -> all audio bytes, word timings and the summary (for unary APIs)."""
        ...
