"""What the Riva and Google compatibility servicers share: seeds, language matching, errors, relaying.

Neither foreign API has a seed field, yet both services answer the same request with the same
audio. So the compatibility APIs default to a fixed seed (``DEFAULT_COMPAT_SEED``), and a client
may pick another (or ``random``) with the ``x-cadenza-seed`` metadata header.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import TypeVar

import grpc

from service.api.errors import IdleTimeout
from service.engine.api import (
    Engine,
    EngineError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Session,
    SessionEvent,
    VoiceDescription,
)

__all__ = [
    "DEFAULT_COMPAT_SEED",
    "DEFAULT_IDLE_TIMEOUT_S",
    "SEED_METADATA_KEY",
    "CompatServicer",
    "language_matches",
    "next_request",
    "normalize_language",
    "relay_events",
    "renamed",
    "seed_from_metadata",
    "speaker_value",
    "voice_for_language",
]

SEED_METADATA_KEY = "x-cadenza-seed"
DEFAULT_COMPAT_SEED = 0
_RANDOM_SEED_WORDS = frozenset({"random", "none"})
_MAX_SEED = 2**64 - 1
DEFAULT_IDLE_TIMEOUT_S = 60.0
T = TypeVar("T")


class CompatServicer:
    """What the Riva and Google servicers share: the engine, the default seed and the idle limit."""

    def __init__(
        self,
        engine: Engine,
        default_seed: int | None = DEFAULT_COMPAT_SEED,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        self._engine = engine
        self._default_seed = default_seed
        self._idle_timeout_s = idle_timeout_s

    def _seed(self, context: grpc.aio.ServicerContext) -> int | None:
        """The request's seed: the `x-cadenza-seed` header, else the default."""
        return seed_from_metadata(context.invocation_metadata(), self._default_seed)


def seed_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None, default: int | None) -> int | None:
    """The seed named by the ``x-cadenza-seed`` header ("random" for none), else `default`."""
    for key, value in metadata or ():
        if key.lower() != SEED_METADATA_KEY:
            continue
        text = (value.decode() if isinstance(value, bytes) else value).strip()
        return parse_seed(text, SEED_METADATA_KEY)
    return default


def parse_seed(text: str, field: str) -> int | None:
    """An unsigned 64-bit seed, or None for "random"/"none"."""
    if text.lower() in _RANDOM_SEED_WORDS:
        return None
    try:
        seed = int(text)
    except ValueError:
        raise InvalidArgument(field, f"expected an integer seed 0..2^64-1 or 'random', got {text!r}") from None
    if not 0 <= seed <= _MAX_SEED:
        raise InvalidArgument(field, f"seed must be in 0..2^64-1, got {seed}")
    return seed


def speaker_value(label: str | None) -> int | str | None:
    """A speaker label as the native API reads it: digits are an index, anything else a name."""
    if not label:
        return None
    return int(label) if label.isdigit() else label


def renamed(error: EngineError, fields: Mapping[str, str]) -> EngineError:
    """The error with a native field name (``config.sample_rate``) replaced by the foreign API's."""
    if not isinstance(error, InvalidArgument) or error.field not in fields:
        return error
    return InvalidArgument(fields[error.field], error.message.removeprefix(f"{error.field}: "))


def normalize_language(code: str) -> str:
    """BCP-47 in one spelling: ``en_us`` and ``EN-US`` both become ``en-us``."""
    return code.strip().replace("_", "-").lower()


def language_matches(requested: str, voice_language: str) -> bool:
    """True if `requested` names the voice's language; a bare ``en`` matches any English voice."""
    want, have = normalize_language(requested), normalize_language(voice_language)
    if not want:
        return True
    return want == have or ("-" not in want and have.split("-")[0] == want)


def voice_for_language(
    voices: Sequence[VoiceDescription], language: str, default_voice: str, field: str
) -> VoiceDescription:
    """The default voice if it speaks `language`, else the first voice that does."""
    if not voices:
        raise FailedPrecondition("this server has no voices loaded")
    ordered = sorted(voices, key=lambda v: v.name != default_voice)  # stable: default first
    for voice in ordered:
        if language_matches(language, voice.language):
            return voice
    languages = ", ".join(sorted({v.language for v in voices}))
    raise NotFound(f"{field}: no voice speaks {language!r}; languages available: {languages}")


def check_language(voice: VoiceDescription, language: str, field: str) -> None:
    """Reject a language code that the chosen voice does not speak."""
    if not language_matches(language, voice.language):
        raise InvalidArgument(
            field,
            f"voice {voice.name} speaks {voice.language}, not {language!r}; send {voice.language} or leave it empty",
        )


async def next_request(requests: AsyncIterator[T], idle_timeout_s: float) -> T | None:
    """The client's next message, None once it half-closes; IdleTimeout if it goes quiet too long."""
    try:
        return await asyncio.wait_for(anext(requests), idle_timeout_s)
    except StopAsyncIteration:
        return None
    except TimeoutError:
        raise IdleTimeout(f"no message for {idle_timeout_s:g} s; close the stream when the text is complete") from None


async def relay_events(session: Session, reader: asyncio.Task[None] | None = None) -> AsyncIterator[SessionEvent]:
    """The session's events, stopping with the reader's error as soon as the request side fails.

    Waiting on both keeps a bad input message from hanging the stream behind pending audio.
    """
    events = aiter(session.events())
    pending: asyncio.Future[SessionEvent] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            waiters: set[asyncio.Future[object]] = {pending}  # type: ignore[arg-type]
            if reader is not None and not reader.done():
                waiters.add(reader)  # type: ignore[arg-type]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if reader is not None and reader.done() and not reader.cancelled():
                error = reader.exception()
                if error is not None:
                    raise error
            if pending.done():
                done, pending = pending, None
                try:
                    event = done.result()
                except StopAsyncIteration:
                    return
                yield event
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
