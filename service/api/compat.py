"""What the Riva and Google compatibility servicers share: seeds, language matching, errors, relaying.

Neither foreign API has a seed field, yet both services answer the same request with the same
audio. So the compatibility APIs default to a fixed seed (``DEFAULT_COMPAT_SEED``), and a client
may pick another (or ``random``) with the ``x-cadenza-seed`` metadata header.
"""

from __future__ import annotations

import asyncio
import re
import time
import unicodedata
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Generic, TypeVar

import grpc

from service.api.errors import IdleTimeout, renamed
from service.audio.encoding import AudioEncoding
from service.engine.contract import (
    MAX_SAMPLE_RATE,
    MIN_SAMPLE_RATE,
    Engine,
    FailedPrecondition,
    Gender,
    InvalidArgument,
    NotFound,
    OutOfRange,
    Session,
    SessionEvent,
    VoiceDescription,
    echo,
)

__all__ = [
    "DEFAULT_COMPAT_SEED",
    "DEFAULT_IDLE_TIMEOUT_S",
    "SEED_METADATA_KEY",
    "UNARY_CHARS_PER_SECOND",
    "CompatServicer",
    "RequestReader",
    "check_response_size",
    "check_unary_size",
    "language_matches",
    "normalize_language",
    "relay_events",
    "renamed",
    "seed_from_metadata",
    "speaker_value",
    "spoken_chars",
    "unary_text",
    "voice_for_language",
]

SEED_METADATA_KEY = "x-cadenza-seed"
DEFAULT_COMPAT_SEED = 0
_RANDOM_SEED_WORDS = frozenset({"random", "none"})
_MAX_SEED = 2**64 - 1
DEFAULT_IDLE_TIMEOUT_S = 60.0
# Unary size check: spoken characters (see `spoken_chars`) per second of audio, on the low side
# (voices speak about 14-16 at rate 1.0), so a text refused up front would almost surely not have
# fit in one message.
UNARY_CHARS_PER_SECOND = 10.0
_SILENT_CATEGORIES = frozenset({"Mn", "Me", "Cf"})
_DIGIT_CHARS = 3  # a digit is read as a word ("7" -> "seven", "2023" -> "twenty twenty-three")
_SPEAKER_INDEX = re.compile(r"[0-9]{1,9}")
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
        raise InvalidArgument(field, f"expected an integer seed 0..2^64-1 or 'random', got {echo(text)}") from None
    if not 0 <= seed <= _MAX_SEED:
        raise InvalidArgument(field, f"seed must be in 0..2^64-1, got {seed}")
    return seed


def speaker_value(label: str | None) -> int | str | None:
    """A speaker label as the native API reads it: ASCII digits are an index, anything else a name
    ("²" passes str.isdigit() but is no number: the engine answers NOT_FOUND for it)."""
    if not label:
        return None
    return int(label) if _SPEAKER_INDEX.fullmatch(label) else label


def unary_text(text: str, field: str = "text") -> str:
    """The text of a one-shot request: empty or whitespace-only is INVALID_ARGUMENT."""
    if not text.strip():
        raise InvalidArgument(field, "text is empty; send the text to speak")
    return text


def spoken_chars(text: str, stop_after: int | None = None) -> int:
    """What a text costs in audio, in characters of plain prose: combining marks and format
    characters (zero-width joiners, direction marks) add none, a whitespace run is one pause,
    a digit counts as the word it is read as. Counting stops past ``stop_after``."""
    count = 0
    space = False
    for ch in text:
        if ch.isspace():
            count += not space
            space = True
        elif unicodedata.category(ch) not in _SILENT_CATEGORIES:
            count += _DIGIT_CHARS if ch.isdecimal() else 1
            space = False
        if stop_after is not None and count > stop_after:
            break
    return count


def check_unary_size(
    text: str,
    *,
    sample_rate: int,
    encoding: AudioEncoding,
    speaking_rate: float,
    max_message_bytes: int,
    extra_bytes: int,
    streaming_rpc: str,
) -> None:
    """Refuse (OUT_OF_RANGE) a text whose audio would not fit in one response message, before any
    synthesis: the audio is estimated from its `spoken_chars` at `UNARY_CHARS_PER_SECOND` (scaled
    by the speaking rate), not its length, which marks that make no sound would inflate; and
    `extra_bytes` covers the rest of the response (headers, echoed text, word timings)."""
    if not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE:
        return  # the engine refuses the rate itself (INVALID_ARGUMENT)
    chars_per_second = UNARY_CHARS_PER_SECOND * max(speaking_rate, 1e-3)
    fits = int((max_message_bytes - extra_bytes) / (sample_rate * encoding.bytes_per_sample) * chars_per_second)
    spoken = spoken_chars(text, stop_after=max(fits, 0))
    if spoken <= fits:
        return
    seconds = spoken_chars(text) / chars_per_second
    estimate = int(seconds * sample_rate) * encoding.bytes_per_sample + extra_bytes
    raise OutOfRange(
        f"text of {len(text)} characters makes about {seconds:.0f} s of audio (~{estimate / 1e6:.1f} MB at "
        f"{sample_rate} Hz {encoding.name}), more than one response message may carry ({max_message_bytes} bytes); "
        f"send it through {streaming_rpc}, which streams the audio in chunks (or keep unary texts under about "
        f"{max(fits, 0)} characters of prose)"
    )


def check_response_size(size: int, max_message_bytes: int, streaming_rpc: str) -> None:
    """After synthesis: a response past the message limit is OUT_OF_RANGE too (the estimate was low)."""
    if size > max_message_bytes:
        raise OutOfRange(f"the audio came to {size} bytes, more than one response message may carry "
                         f"({max_message_bytes} bytes); send this text through {streaming_rpc}")


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
    voices: Sequence[VoiceDescription], language: str, default_voice: str, field: str,
    gender: Gender = Gender.UNSPECIFIED,
) -> VoiceDescription:
    """The default voice if it speaks `language`, else the first voice that does. A `gender` is a
    preference (Google's ssml_gender): the first such voice of the language, else as without one."""
    if not voices:
        raise FailedPrecondition("this server has no voices loaded")
    ordered = sorted(voices, key=lambda v: v.name != default_voice)  # stable: default first
    speaking = [v for v in ordered if language_matches(language, v.language)]
    for voice in speaking:
        if gender is Gender.UNSPECIFIED or voice.gender is gender:
            return voice
    if speaking:
        return speaking[0]
    languages = ", ".join(sorted({v.language for v in voices}))
    raise NotFound(f"{field}: no voice speaks {echo(language)}; languages available: {languages}")


def check_language(voice: VoiceDescription, language: str, field: str) -> None:
    """Reject a language code that the chosen voice does not speak."""
    if not language_matches(language, voice.language):
        raise InvalidArgument(
            field,
            f"voice {voice.name} speaks {voice.language}, not {echo(language)}; "
            f"send {voice.language} or leave it empty",
        )


class RequestReader(Generic[T]):
    """A client's request stream, read with an idle limit: `next()` raises IdleTimeout once it has
    waited `idle_timeout_s` for a message.

    With a `session` (set once it is open), the idle time counts only while the server has had
    nothing left to send as well (`Session.quiet_s`): a client that listens to long audio without
    writing is not idle. The limit is kept by one timer per stream that re-arms itself when it
    fires early, not by a task and a timed wait per message: the server reads every text delta
    of every stream, and such a wait cost more of its event loop than the read itself.
    """

    def __init__(self, requests: AsyncIterator[T], idle_timeout_s: float,
                 hint: str = "close the stream when the text is complete") -> None:
        self.requests = aiter(requests)
        self.idle_timeout_s = idle_timeout_s
        self.session: Session | None = None
        self._hint = hint
        self._waiter: asyncio.Task[Any] | None = None  # the task waiting in `next`, if one is
        self._waiting_since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False

    async def next(self) -> T | None:
        """The next message, None once the client half-closes."""
        self._waiter = asyncio.current_task()
        self._waiting_since = time.monotonic()
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.idle_timeout_s, self._check)
        try:
            return await anext(self.requests)
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            if not self._expired:
                raise
            assert self._waiter is not None
            self._waiter.uncancel()
            raise IdleTimeout(f"no message for {self.idle_timeout_s:g} s; {self._hint}") from None
        finally:
            self._waiter = None

    def close(self) -> None:
        """The stream is over: drop the timer now (it would hold the session until it fired)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.session = None

    def _check(self) -> None:
        """The timer: cancel the wait if it is idle, else fire again when it could be. Not waiting
        (a message is being handled): no timer until the next wait."""
        self._timer = None
        if self._waiter is None:
            return
        now = time.monotonic()
        left = self.idle_timeout_s - (now - self._waiting_since)
        if left <= 0 and self.session is not None:
            left = self.idle_timeout_s - self.session.quiet_s(now)
        if left > 0:
            self._timer = asyncio.get_running_loop().call_later(left, self._check)
            return
        self._expired = True
        self._waiter.cancel()


async def relay_events(session: Session, reader: asyncio.Task[None] | None = None) -> AsyncIterator[SessionEvent]:
    """The session's events, stopping with the reader's error as soon as the request side fails
    (a bad input message must not hang the stream behind pending audio)."""
    def failed(task: asyncio.Task[None]) -> None:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            session.interrupt(error)

    if reader is not None:
        reader.add_done_callback(failed)
    async for event in session.events():
        yield event
