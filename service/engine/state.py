"""Engine-thread state: what a session is doing, typed, and the records that cross threads.

Only the engine thread touches `SessionState` and `UtteranceState`; the event loop sees a
session through its `Sink` (results posted with call_soon_threadsafe)."""

from __future__ import annotations

import enum
import itertools
import math
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from service.engine.cache import CachedUtterance
    from service.models.family import (
        ChunkSchedule,
        DecoderInput,
        SynthesisParams,
        TokenStage,
        UtteranceDecoder,
        VoiceRuntime,
    )
    from service.text.frontend import PhonemizedSentence


@dataclass
class ChunkResult:
    """One decoded chunk, handed to the session on its event loop."""

    samples: np.ndarray  # float32 at the voice's rate
    utterance: int
    word_spans: list[tuple[str, int, int]]  # on an utterance's first chunk; utterance-relative samples
    precision: str
    fallback: bool
    cached: bool
    # The same samples as 16-bit PCM (`float_to_int16`'s), where the step's guard made them on
    # the device: outputs of 16-bit PCM at the voice's rate take these, no conversion per chunk.
    pcm16: np.ndarray | None = None


class Loop(Protocol):
    """Where the output stage hands a session's results: its asyncio event loop, or (for a
    core in its own process) the outbox to the server."""

    def call_soon_threadsafe(self, callback: Callable[..., object], *args: object) -> object: ...


class Sink(Protocol):
    """Loop-side receiver of one session's results (called on its event loop)."""

    def on_chunk(self, chunk: ChunkResult) -> None: ...

    def on_done(self) -> None: ...

    def on_error(self, exc: BaseException) -> None: ...


@dataclass
class ReadCursor:
    """Seconds of a session's audio queued for its client and taken by it so far (plain floats,
    each written by one thread: no lock needed). With the core on a thread there is one cursor:
    the session's event loop writes both figures, the engine thread reads them. With the core in
    its own process each side has its copy: the server's loop writes its own, and in the core
    the outbox thread adds what it delivers while the relay of the server's messages sets
    `read_s` (`proc.take_reads`); the engine thread reads the core's copy."""

    delivered_s: float = 0.0
    read_s: float = 0.0


@dataclass(frozen=True)
class SessionRequest:
    """A session as the server resolved it: the part of its spec that can cross to an engine
    core in another process (plain values, no loaded model, no event loop)."""

    session_id: int
    voice_name: str
    sid: int | None
    params: SynthesisParams  # length_scale, family options, seed resolved by the engine
    schedule: ChunkSchedule
    precision: str  # "fp16" | "fp32"
    custom_dictionary: Mapping[str, str] | None
    word_timings: bool = True  # the client asked for word timings (without: the frontend skips word alignment)
    internal: bool = False  # the server's own warm-up session (not profiled)
    max_phonemes: int | None = None  # phonemes the session may have spoken; more fails it (RESOURCE_EXHAUSTED)
    voice_prompt: Any = None  # the session's own speaker, as its family made it (`Family.voice_prompt`)


@dataclass(frozen=True, kw_only=True)
class WorkSpec(SessionRequest):
    """Everything the engine thread needs to synthesise for one session: the request plus
    what lives where the core runs (the loaded voice) and where its results go."""

    runtime: VoiceRuntime
    sink: Sink
    loop: Loop
    cursor: ReadCursor = field(default_factory=ReadCursor)

    @staticmethod
    def of(request: SessionRequest, runtime: VoiceRuntime, sink: Sink, loop: Loop,
           cursor: ReadCursor) -> WorkSpec:
        return WorkSpec(runtime=runtime, sink=sink, loop=loop, cursor=cursor, **vars(request))


class SessionStatus(enum.Enum):
    """Where a session is, as the scheduler sees it."""

    IDLE = "idle"  # nothing to synthesise now: waiting for text (or for the client to catch up)
    ACTIVE = "active"  # has text in the acoustic queue or audio to decode
    FINISHED = "finished"  # input ended and every chunk was delivered
    FAILED = "failed"
    CANCELLED = "cancelled"


class UtteranceStatus(enum.Enum):
    ACOUSTIC = "acoustic"  # waiting for (or in) the acoustic stage
    TOKENS = "tokens"  # an autoregressive family is making its decoder input, one batched step at a time
    DECODING = "decoding"  # decoder input ready; chunks being decoded
    CACHED = "cached"  # replayed from the result cache
    DONE = "done"


@dataclass
class UtteranceState:
    """One sentence of a session, from the acoustic stage to its last chunk."""

    index: int
    sentence: PhonemizedSentence
    status: UtteranceStatus = UtteranceStatus.ACOUSTIC
    precision: str = "fp32"  # starts at the session's; FP32 for the rest after a guard trip
    decoder_input: DecoderInput | None = None
    word_spans: list[tuple[str, int, int]] = field(default_factory=list)
    cached: CachedUtterance | None = None
    cache_key: Hashable | None = None
    chunks: list[np.ndarray] = field(default_factory=list)  # kept for the cache
    precisions: list[str] = field(default_factory=list)
    chunk_index: int = 0  # chunks delivered
    # Slot decoding: the device slot and decoder frames fed so far.
    slot: int | None = None
    fed: int = 0
    # Staged decoding (CPU): the utterance's staged decoder and its chunk boundaries.
    staged: UtteranceDecoder | None = None
    bounds: list[int] = field(default_factory=list)
    samples_done: int = 0  # audio samples delivered

    @property
    def frames(self) -> int:
        return 0 if self.decoder_input is None else self.decoder_input.frames

    def ready_frames(self, tokens: TokenStage | None) -> int:
        """Frames its decoder can make now: all of them once its input is complete; while an
        autoregressive family still makes tokens, what the tokens so far allow."""
        if self.status is UtteranceStatus.TOKENS and tokens is not None and self.decoder_input is not None:
            return tokens.ready_frames(self.decoder_input)
        return self.frames


@dataclass
class FirstAudioMarks:
    """When a session's first sentence passed each stage on its way to first audio (monotonic
    seconds): where time to first audio goes, per session."""

    sent: float | None = None  # handed to the frontend
    phonemized: float | None = None  # the frontend finished it (then it waits for the engine thread)
    acoustic_start: float | None = None
    acoustic_end: float | None = None
    step_start: float | None = None  # the decoder step that made the first chunk

    def stages(self, emitted: float) -> dict[str, float]:
        """Seconds spent in each stage, for the stages whose both ends are known."""
        points = [("frontend", self.sent), ("acoustic_wait", self.phonemized), ("acoustic", self.acoustic_start),
                  ("decoder_wait", self.acoustic_end), ("decoder", self.step_start), ("", emitted)]
        out: dict[str, float] = {}
        for (name, at), (_, end) in itertools.pairwise(points):
            if at is not None and end is not None:
                out[name] = max(0.0, end - at)
        return out


@dataclass
class SessionState:
    """Engine-thread state of one session."""

    spec: WorkSpec
    rng: np.random.Generator | None  # unseeded sessions: one random generator
    status: SessionStatus = SessionStatus.IDLE
    utterances: deque[UtteranceState] = field(default_factory=deque)
    ended: bool = False  # the client ended its input
    next_index: int = 0
    samples_out: int = 0  # model-rate samples delivered (the playback clock)
    first_audio_at: float | None = None
    first_text_at: float | None = None  # when its first sentence reached the engine
    marks: FirstAudioMarks = field(default_factory=FirstAudioMarks)
    held_since: float | None = None  # when backpressure last started holding it back
    read_at_hold: float = 0.0  # the client's read cursor then (reading restarts the stall clock)
    ready_since: float = 0.0  # when it last got new work or output (ties in urgency)

    @property
    def sample_rate(self) -> int:
        return self.spec.runtime.sample_rate

    def slack(self, now: float) -> float:
        """Seconds of audio the client still has buffered (-inf before the first chunk)."""
        if self.first_audio_at is None:
            return -math.inf
        return self.first_audio_at + self.samples_out / self.sample_rate - now

    def unread_s(self) -> float:
        """Audio delivered to the session that its client has not taken yet (seconds)."""
        return self.spec.cursor.delivered_s - self.spec.cursor.read_s

    def past_acoustic(self) -> list[UtteranceState]:
        """The utterances through the acoustic stage (or cached): a prefix of the queue, as a
        session's sentences enter that stage in order, so a scan stops at the first one waiting
        for it (a long text queues hundreds, and the scheduler looks at every session each
        iteration)."""
        return list(itertools.takewhile(lambda u: u.status is not UtteranceStatus.ACOUSTIC, self.utterances))

    def queued_audio_s(self, past: list[UtteranceState] | None = None) -> float:
        """Audio already through the acoustic stage but not yet delivered (seconds); `past`:
        `past_acoustic()` where the caller has it."""
        hop = self.spec.runtime.hop
        samples = sum(u.frames * hop - u.samples_done for u in (self.past_acoustic() if past is None else past)
                      if u.decoder_input is not None)
        return samples / self.sample_rate

    @property
    def head(self) -> UtteranceState | None:
        return self.utterances[0] if self.utterances else None

    @property
    def done(self) -> bool:
        return self.ended and not self.utterances


@dataclass
class EngineStats:
    steps: int = 0  # batched decoder steps (or staged chunks)
    rows: int = 0  # session rows over all steps
    max_rows: int = 0
    step_seconds: float = 0.0  # wall time inside decoder steps
    audio_seconds: float = 0.0  # audio produced by them
    acoustic_jobs: int = 0
    acoustic_seconds: float = 0.0  # wall time inside acoustic-stage calls
    acoustic_batches: int = 0
    overlapped: int = 0  # acoustic-stage calls made while a decoder step ran on the device
    token_steps: int = 0  # autoregressive steps
    token_steps_overlapped: int = 0  # of them, made while a decoder step ran on the device
    fallbacks: int = 0
    nonfinite_fp32: int = 0
