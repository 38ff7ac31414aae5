"""The model-family contract: everything the engine, the API and the tools know of a model.

A family (VITS/Piper, Kokoro, CosyVoice2) lives in its own folder under `service/models/` and is listed in
`service.models.registry`. It gives:

* `Family`: recognises its voices from their files (`VoiceInfo`, read without loading
  weights), builds its text frontend, declares its options (typed ranges, e.g. VITS's noise
  scales) and opens a voice on a backend as a `VoiceRuntime`;
* `VoiceRuntime`: the loaded voice as the engine drives it: an acoustic stage over a batch of
  sentences (-> one `DecoderInput` per sentence: frame count, word spans, the prior the
  decoder draws from), a `StreamingDecoder` (fixed-shape batched steps over device slots), or
  for a CPU backend an `UtteranceDecoder` per utterance, the device guard, and a reference
  full decode (the exactness oracle, and the shadow verifier's FP32 reference).

How the next families map onto it:

* Kokoro-82M (StyleTTS2 text encoder, prosody predictor, iSTFTNet with a sine source): the
  acoustic stage predicts durations, F0 and energy and gives per-frame decoder input (a `Prior`
  whose columns are frames, `src` the identity, sigma 0; the utterance's style vector is its own
  field of the family's `DecoderInput`); its `StreamingDecoder` keeps the sine source's phase and
  the inverse STFT's overlap in each slot's state.
* CosyVoice2 (a Qwen2 LM emitting 25 Hz speech tokens, chunked flow matching, HiFT): gives a
  `TokenStage` (`VoiceRuntime.tokens`); the acoustic stage tokenises and prefills, its `step` decodes
  one token for every utterance still making tokens over a KV cache in slots, and the scheduler's
  plan holds those rows (`Plan.tokens`) beside acoustic batches and decoder steps. Today an
  utterance is decoded once its tokens are complete (`service.models.cosyvoice2.runtime`).

Nothing here imports torch: the server's API process reads voices and options through it."""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

if TYPE_CHECKING:
    from service.text.frontend import PhonemizedSentence


class VoiceNotFoundError(LookupError):
    pass


@dataclass(frozen=True)
class OptionSpec:
    """A family option a request may set (e.g. VITS's `noise_scale`): its range and the voice's default."""

    name: str
    default: float
    low: float
    high: float
    help: str


class Gender(enum.StrEnum):
    """A voice's gender as its family declares it: what the APIs' voice lists show, and what a
    Google request's `ssml_gender` prefers. UNSPECIFIED where the voice's files do not say."""

    FEMALE = "female"
    MALE = "male"
    UNSPECIFIED = "unspecified"

    @classmethod
    def of(cls, value: object) -> Gender:
        """A configuration's word for it ("female", "F", "male", ...); anything else is UNSPECIFIED."""
        word = str(value or "").strip().lower()
        return {"female": cls.FEMALE, "f": cls.FEMALE, "male": cls.MALE, "m": cls.MALE}.get(word, cls.UNSPECIFIED)


@dataclass(frozen=True)
class VoiceInfo:
    """Everything the server says about a voice without loading its weights."""

    name: str
    family: str  # a `service.models.registry` name
    model_path: Path  # the file the voice was recognised from
    config_path: Path  # the family's configuration file for it
    frontend_key: str  # "<family>:<source>": what its text frontend is built from (a frontend worker loads it)
    sample_rate: int
    language: str  # BCP-47
    num_speakers: int
    speaker_id_map: Mapping[str, int]
    length_scale: float  # the voice's default pace (1 / speaking rate)
    options: tuple[OptionSpec, ...] = ()
    gender: Gender = Gender.UNSPECIFIED
    # Its first audio waits for a whole utterance (the decoder cannot start on part of one): the
    # segmenter cuts its streams into growing pieces (`service.text.segment`).
    decodes_whole_utterances: bool = False
    # A request may change its pace (speaking rate) and its pronunciations (a custom dictionary of
    # phonemes): False for a family that has neither control (CosyVoice2 reads text, at its own pace).
    pace: bool = True
    pronunciations: bool = True
    # A session may bring its own speaker as a recording (zero-shot: `Family.voice_prompt`).
    voice_prompts: bool = False

    def option(self, name: str) -> OptionSpec:
        for spec in self.options:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def resolve_options(self, given: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
        """Request options checked against the family's declaration (ValueError naming what to change)."""
        known = {o.name: o for o in self.options}
        out = []
        for name, value in sorted(given.items()):
            spec = known.get(name)
            if spec is None:
                accepted = ", ".join(known) or "none"
                raise ValueError(f"voice {self.name} ({self.family}) has no option {name!r}; it takes: {accepted}")
            if not (math.isfinite(value) and spec.low <= value <= spec.high):
                raise ValueError(f"option {name}={value} is outside {spec.low:g}..{spec.high:g} "
                                 f"(unset = the voice's default, {spec.default:g})")
            out.append((name, float(value)))
        return tuple(out)

    def speaker_index(self, speaker: int | str | None) -> int | None:
        """Resolve a speaker id or name; None means the voice's default (0)."""
        if self.num_speakers <= 1:
            if speaker not in (None, 0, "", "0"):
                raise VoiceNotFoundError(f"voice {self.name} has a single speaker; got speaker {speaker!r}")
            return None
        if speaker is None or speaker == "":
            return 0
        if isinstance(speaker, str) and not speaker.isdigit():
            if speaker not in self.speaker_id_map:
                raise VoiceNotFoundError(
                    f"voice {self.name} has no speaker {speaker!r}; known: "
                    f"{', '.join(sorted(self.speaker_id_map)) or '0..' + str(self.num_speakers - 1)}"
                )
            return int(self.speaker_id_map[speaker])
        index = int(speaker)
        if not 0 <= index < self.num_speakers:
            raise VoiceNotFoundError(f"voice {self.name} has speakers 0..{self.num_speakers - 1}; got {index}")
        return index


@dataclass(frozen=True)
class SynthesisParams:
    """Per-request controls; None means the voice's default. `options` holds the family options
    the request set (checked by `VoiceInfo.resolve_options`); the family reads them."""

    speaker: int | str | None = None
    length_scale: float | None = None
    options: tuple[tuple[str, float], ...] = ()
    seed: int | None = None
    precision: str = "fp32"
    custom_dictionary: Mapping[str, str] | None = None

    def option(self, spec: OptionSpec) -> float:
        return dict(self.options).get(spec.name, spec.default)


@dataclass(frozen=True)
class ChunkSchedule:
    """Latent frames per chunk: small first (time to first audio), then growing (throughput:
    every chunk pays its context), capped. Where a stream's text is cut into utterances is the
    segmenter's business (service/text/segment.py), not the schedule's."""

    first_frames: int = 32  # an utterance's first chunk: room for the next chunk even with 8 sessions on 2 cores
    # The staged decoder's (a CPU's) first chunk of a stream's first utterance while no other
    # session waits, where shorter than first_frames: each frame of it is first-audio time, and
    # alone the next chunk still finishes before it has played. With others waiting, first_frames:
    # their first chunks go in between.
    staged_first_frames: int = 8
    # After that shorter first chunk the staged chunks grow by this factor, so each is made
    # while the chunks before it play: that holds for a decoder at up to about 1 / g of real time.
    staged_growth: float = 4.0
    growth: float = 16.0  # 32 -> 512 -> 1024: chunk k+1 still finishes well before chunk k has played
    max_frames: int = 1024
    later_first_frames: int = 1024  # first chunk of a stream's later utterances (audio is already playing)
    flow_piece_frames: int = 256  # staged decoding: after the first chunk, the first stage runs this far ahead

    def __post_init__(self) -> None:
        if min(self.first_frames, self.staged_first_frames) < 1 or self.max_frames < self.first_frames \
                or min(self.growth, self.staged_growth) < 1.0:
            raise ValueError("chunk schedule needs first_frames and staged_first_frames >= 1, "
                             "max_frames >= first_frames, growth and staged_growth >= 1")

    def first_chunk(self, utterance_index: int) -> int:
        """Frames in an utterance's first chunk: small for the stream's first utterance (time
        to first audio), larger later (throughput)."""
        if utterance_index == 0:
            return self.first_frames
        return max(self.first_frames, min(self.later_first_frames, self.max_frames))

    def staged_boundaries(self, total: int) -> list[int]:
        """`boundaries` from the staged decoder's shorter first chunk, growing by `staged_growth`."""
        return self.boundaries(total, self.staged_first_frames, self.staged_growth)

    def boundaries(self, total: int, first: int | None = None, growth: float | None = None) -> list[int]:
        """Frame boundaries 0 = b0 < b1 < ... < bn = total."""
        out, pos, size = [0], 0, float(first or self.first_frames)
        while pos < total:
            pos = min(total, pos + int(size))
            if pos > out[-1] + self.first_frames and total - pos < self.first_frames:
                pos = total  # no runt chunk at the end: it would cost a whole context for a few frames
            out.append(pos)
            size = min(float(self.max_frames), size * (growth or self.growth))
        return out


@dataclass(frozen=True)
class WordTiming:
    word: str
    start: int  # samples from the start of the stream
    end: int


@dataclass
class AcousticJob:
    """One sentence waiting for the acoustic stage, with its own noise generator."""

    sentence: PhonemizedSentence
    sid: int | None
    params: SynthesisParams
    rng: np.random.Generator
    prompt: Any = None  # the session's own speaker (`Family.voice_prompt`), in place of `sid`


def utterance_rng(seed: int | None, phoneme_ids: Sequence[int]) -> np.random.Generator:
    """Noise for one utterance. Seeded: drawn from (seed, phoneme ids), so the same sentence
    with the same seed sounds the same wherever it occurs (and results can be cached);
    unseeded: fresh entropy."""
    if seed is None:
        return np.random.default_rng()
    digest = hashlib.blake2b(np.asarray(phoneme_ids, dtype=np.int64).tobytes(), digest_size=8).digest()
    return np.random.default_rng([seed, int.from_bytes(digest, "little")])


class TextFrontend(Protocol):
    """A voice's text frontend: text (with inline annotations and a custom dictionary) to the
    sentences its acoustic stage takes, with word spans for timings. Thread safe."""

    def sentences(self, text: str, custom_dictionary: Mapping[str, str] | None = None,
                  words: bool = True) -> list[PhonemizedSentence]: ...


class Prior(Protocol):
    """An utterance's decoder input as a decoder draws it: frame t is mean[:, src[t]] +
    sigma[:, src[t]] x noise, where noise is `service.models.noise.counter_normal(key, t)` (a
    family without noise has sigma = 0)."""

    key: int
    src: np.ndarray  # [T] column of each frame
    # A family whose acoustic stage runs on the decoder's device may give mean and sigma there
    # instead, as one [2, C, P] tensor (the decoder then copies them on the device); else None.
    device_values: Any

    @property
    def mean(self) -> np.ndarray:
        """[C, P] per column."""
        ...

    @property
    def sigma(self) -> np.ndarray:
        """[C, P] noise scale per column."""
        ...

    @property
    def frames(self) -> int: ...

    @property
    def phonemes(self) -> int:
        """Columns of mean and sigma."""
        ...


class DecoderInput(Protocol):
    """One sentence after the acoustic stage, ready for chunked decoding."""

    @property
    def prior(self) -> Prior: ...

    @property
    def sid(self) -> int | None: ...

    @property
    def word_spans(self) -> list[tuple[str, int, int]]:
        """(word, start_sample, end_sample), utterance-relative (from the predicted durations)."""
        ...

    @property
    def frames(self) -> int:
        """Decoder frames; the utterance is frames x hop samples long."""
        ...


@dataclass(frozen=True)
class StepRows:
    """One batched decoder step: every row advances its slot by `frames` frames, the next
    frames of the input its slot was started with (zero past the utterance's end).

    `fed[i]` is how many frames row i's utterance had already been fed."""

    slots: Sequence[int]
    fed: Sequence[int]
    frames: int
    sids: Sequence[int] | None


class StreamingDecoder(Protocol):
    """Decoder input -> audio, streamed, for many sessions at once (one precision)."""

    precision: str
    hop: int  # audio samples per frame
    lag: int  # frames the audio trails the input (the stages' right context)
    capacity: int  # slots
    step_seconds: dict[tuple[int, int], float]  # (rows, frames) -> measured time of one step (may be empty)

    def start(self, slot: int, prior: Prior) -> bool:
        """Begin `prior`'s utterance in `slot`: clear the slot's state and keep the input on the
        device. False when the decoder's input memory is full: the slot then holds nothing; try
        again when an utterance is freed. ValueError for an input longer than that memory can
        ever hold."""
        ...

    def free(self, slot: int) -> None:
        """The slot's utterance is over: give back its input memory."""
        ...

    def capture_all(self) -> None:
        """Prepare every step shape now (CUDA graphs), so no session pays for it later."""
        ...

    def step(self, rows: StepRows) -> Any:
        """Advance every row by `rows.frames` frames. Returns the audio [B, frames x hop]
        covering positions (fed - lag) x hop onwards, on the device; positions outside the
        utterance are 0. `VoiceRuntime.guard_async` takes it."""
        ...


class UtteranceDecoder(Protocol):
    """One utterance decoded alone, chunk by chunk, in order (a CPU backend's staged decoding:
    each stage's output kept between chunks)."""

    precision: str  # what makes its audio: "fp32", or "int8" where the backend quantized its stages

    def audio(self, start: int, end: int) -> np.ndarray:
        """Audio samples [start, end), float32; `start` is where the previous chunk ended."""
        ...


class HostAudio(NamedTuple):
    """A decoder step's guarded audio on the host."""

    audio: np.ndarray  # [B, S] float32; non-finite samples zeroed
    nonfinite: np.ndarray  # [B] int64, non-finite samples the guard saw per row
    pcm16: np.ndarray | None  # [B, S] int16, the same audio as 16-bit PCM, where the guard made it


class PendingAudio(Protocol):
    def result(self) -> HostAudio:
        """The step's guarded audio on the host (waits for the device)."""
        ...

    def ready(self) -> bool:
        """The device has finished the step: `result` will not wait."""
        ...


def guard_host(audio: np.ndarray) -> HostAudio:
    """The guard for audio already on the host: count and zero non-finite samples."""
    finite = np.isfinite(audio)
    clean = np.where(finite, audio, np.float32(0.0)).astype(np.float32, copy=False)
    return HostAudio(clean, (~finite).sum(axis=1), None)


@dataclass(frozen=True)
class Capabilities:
    """What a loaded voice offers, declared by its family and backend: the engine reads these
    flags and never probes for methods."""

    slot_decoder: bool = False  # streaming_decoder(): batched fixed-shape steps over device slots
    staged_decoder: bool = False  # utterance_decoder(): each utterance decoded alone, stage by stage (FP32, INT8)
    asynchronous: bool = False  # a decoder step is queued on the device; the engine thread goes on meanwhile
    priors_on_device: bool = False  # the acoustic stage's output stays on the device
    acoustic_split: bool = False  # an acoustic batch is cut by length into several calls
    encoder_graphs: bool = False  # prepare() captures the acoustic stage before serving


class TokenStage(Protocol):
    """An autoregressive family's decoder input made token by token (its state in the family's own
    cache, e.g. a KV cache in device slots)."""

    def step(self, rows: Sequence[DecoderInput | None]) -> Sequence[bool | Exception]:
        """One batched step adding a token to each row's decoder input; True for a row whose input
        is now complete (it is then decoded), the exception for a row that failed alone (its
        session fails; the others go on)."""
        ...

    def release(self, utt: DecoderInput) -> None:
        """`utt` makes no more tokens (its session ended first): free what it holds in the stage."""
        ...

    def ready_frames(self, utt: DecoderInput) -> int:
        """Frames of `utt`'s audio its slot decoder can make from the tokens so far (all of
        `utt.frames` once they are complete): the engine decodes that far while tokens are
        still being made."""
        ...


class VoiceRuntime(Protocol):
    """A voice of some family loaded on a backend: the whole surface the engine uses. One
    instance is driven by one thread (the engine's); the shadow verifier's `reference` calls
    come from its own thread."""

    info: VoiceInfo
    schedule: ChunkSchedule
    capabilities: Capabilities
    backend_name: str
    fp32_pins: tuple[str, ...]  # module patterns kept in FP32 when running FP16 (empty: no FP16)
    pin_candidates: tuple[str, ...]  # what `cadenza precision sensitivity` tries pinning

    @property
    def sample_rate(self) -> int: ...

    @property
    def hop(self) -> int:
        """Audio samples per decoder frame."""
        ...

    def precisions(self) -> tuple[str, ...]: ...

    def prepare(self, max_batch: int) -> None:
        """Before serving: capture what the backend captures (acoustic-stage graphs)."""
        ...

    def acoustic_batch(self, jobs: list[AcousticJob]) -> Sequence[DecoderInput]:
        """The acoustic stage for a batch of sentences; batching never changes a seeded result."""
        ...

    def streaming_decoder(self, precision: str, slots: int, *, max_rows: int, graphs: bool,
                          graph_frames: tuple[int, ...]) -> StreamingDecoder: ...

    def streaming_lag(self) -> int:
        """Frames the streaming decoder's audio trails its input."""
        ...

    def utterance_decoder(self, utt: DecoderInput, precision: str) -> UtteranceDecoder:
        """A staged decoder for `utt` in the session's precision ("int8" where offered, else FP32)."""
        ...

    def guard_async(self, device_audio: Any) -> PendingAudio:
        """Queue the guard (count and zero non-finite samples, make 16-bit PCM) and the copy to
        the host of a decoder step's audio."""
        ...

    def reference(self, utt: DecoderInput, precision: str = "fp32") -> np.ndarray:
        """The whole utterance decoded at once, without chunks: the exactness oracle (tests,
        the shadow verifier). Never on the serving path."""
        ...

    @property
    def tokens(self) -> TokenStage | None:
        """An autoregressive family's token stage; None where the acoustic stage's output is the
        whole decoder input."""
        ...


class ParityCheck(Protocol):
    """A voice against the original implementation it was ported from (`cadenza voices check`):
    the same sentence through both, without randomness or with the same noise."""

    description: str  # what is compared with what, for the report's first line

    def pair(self, sentence: PhonemizedSentence) -> tuple[np.ndarray, np.ndarray]:
        """(original's audio, ours), float32 at the voice's rate; ours decoded whole."""
        ...


class Family(Protocol):
    """A model family: its voices' files, frontend and options, and how to load a voice."""

    name: str
    backends: tuple[str, ...]  # the backends it runs on (--backend)

    def recognise(self, path: Path) -> VoiceInfo | None:
        """The voice at `path` if it is one of this family's (None: not this family's files)."""
        ...

    def discover(self, directory: Path) -> list[VoiceInfo]:
        """This family's voices in `directory`."""
        ...

    def builtin(self) -> VoiceInfo | None:
        """The voice that ships with the package, if this family has one."""
        ...

    def frontend(self, source: str) -> TextFrontend:
        """Its text frontend, from the source a VoiceInfo's `frontend_key` names."""
        ...

    def open(self, info: VoiceInfo, backend: str, device: str, schedule: ChunkSchedule,
             **options: Any) -> VoiceRuntime:
        """Load the voice's weights on `backend`/`device` ("auto": the family's choice for the device)."""
        ...

    def parity(self, runtime: VoiceRuntime, threads: int | None) -> ParityCheck:
        """The check of `runtime` (opened from this family) against the original implementation."""
        ...

    def voice_prompt(self, info: VoiceInfo, audio: bytes, transcript: str | None) -> Any:
        """A session's own speaker from a recording (a WAV file's bytes) and the words spoken in it,
        for a voice with `voice_prompts`: a picklable value its runtime takes as `AcousticJob.prompt`.
        Runs where sessions are opened, off the engine thread. ValueError says what to change."""
        ...


__all__ = [
    "AcousticJob", "Capabilities", "ChunkSchedule", "DecoderInput", "Family", "Gender", "HostAudio", "OptionSpec",
    "ParityCheck", "PendingAudio", "Prior", "StepRows", "StreamingDecoder", "SynthesisParams", "TextFrontend",
    "TokenStage", "UtteranceDecoder", "VoiceInfo", "VoiceNotFoundError", "VoiceRuntime", "WordTiming", "guard_host",
    "utterance_rng",
]
