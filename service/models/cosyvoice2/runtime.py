"""A CosyVoice2 voice on torch, as the engine drives it (`service.models.family.VoiceRuntime`).

* The acoustic stage tokenises nothing (the frontend gave Qwen2 ids): it builds each sentence's
  LM prompt ([sos, prompt text, text, task, prompt speech tokens]), prefills it into a row of the
  shared KV cache (one padded batch for every sentence of the call) and draws the first speech
  token.
* The token stage (`SpeechTokens`, the engine's `TokenStage`) then adds one token to every
  sentence still making tokens in one batched LM step, drawing each sentence's token from its own
  generator, as upstream's `Qwen2LM.inference` draws them (minimum and maximum length per text
  token, end of speech redrawn before the minimum, the two other stop tokens not spoken). A
  sentence's KV row is given back when its tokens are complete.
* The slot decoder (`TokenAudioSlots`) turns a sentence's tokens into audio with upstream's
  streaming token-to-audio (`Token2Wav`: flow chunks of 25 tokens + 3 lookahead, HiFT with its
  cache and cross-fade), chunk by chunk as the engine's steps ask for audio, in FP32 or in FP16
  with FP32 pins; the guard and the engine's FP32 redo work as for any slot decoder.

A sentence's seed gives its tokens and its vocoder noise, so it sounds the same alone or batched.
A sentence is decoded while its tokens are made: the engine asks the token stage how far its audio
can go (`ready_frames`: the streaming chunks the tokens so far allow) and decodes that far."""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.models.cosyvoice2.config import ConfigError
from service.models.cosyvoice2.flow import HalfEstimator
from service.models.cosyvoice2.lm import KVCache, LengthLimits, Nucleus, SpeechLM, nuclei, sample_token
from service.models.cosyvoice2.model import CosyVoice2, load_model
from service.models.cosyvoice2.prompt import MAX_PROMPT_SPEECH_TOKENS
from service.models.cosyvoice2.text import MAX_SENTENCE_TOKENS
from service.models.cosyvoice2.token2wav import Token2Wav, Token2WavState
from service.models.cosyvoice2.voices import SPEAKERS_FILE
from service.models.cuda_graphs import GraphCapturer, GraphTable, bucket, buckets_up_to, own_stream
from service.models.family import (
    AcousticJob,
    Capabilities,
    ChunkSchedule,
    DecoderInput,
    PendingAudio,
    Prior,
    StepRows,
    UtteranceDecoder,
    VoiceInfo,
)
from service.models.mixed_precision import to_mixed_precision
from service.models.transfer import to_device

log = logging.getLogger(__name__)

# FP32 pins are fnmatch patterns over the token-to-audio stage's modules: `flow.decoder.estimator.*`
# (the estimator: ten guided passes per chunk, nearly all of the flow's time) and `hift.*` (the
# vocoder's convolution stack); a pin on the estimator or above it (`flow`) keeps the whole solve
# FP32. The flow's encoder and the vocoder's F0 path (F0 predictor, sine source) are always FP32.
# Why the family pins what it pins:
# - flow: the sine source sums F0 into a phase over each chunk, and F0 is read from the mel, so a
#   mel off by no more than FP16's rounding still drifts that phase, and the waveform with it.
#   Unpinned, the estimator runs FP16 with its Euler state in FP32 (`HalfEstimator`).
# - hift.conv_post: its output goes through exp() (the magnitude).
# `cadenza precision sensitivity --voice DIR` measures each on the served path.
COSYVOICE2_FP32_PINS: tuple[str, ...] = ("flow", "hift.conv_post")
ESTIMATOR = "flow.decoder.estimator"
# The vocoder's F0 path, kept whole in FP32 (the FP32 model's own modules).
FP32_STAGES: tuple[str, ...] = ("f0_predictor", "source")
# Candidates the sensitivity tool tries beside the family's pins (inside the estimator none
# stands out: bench/RESULTS.md, the estimator in FP16).
COSYVOICE2_PIN_CANDIDATES: tuple[str, ...] = (
    "flow", "hift.conv_pre", "hift.ups.*", "hift.resblocks.*", "hift.source_downs.*", "hift.source_resblocks.*",
    "hift.conv_post",
)


@dataclass(frozen=True)
class PinSplit:
    """FP32 pins as each FP16 part takes them."""

    estimator_fp32: bool  # the whole solve in FP32
    estimator: tuple[str, ...]  # patterns relative to the estimator
    vocoder: tuple[str, ...]  # patterns relative to the vocoder


def split_pins(pins: Sequence[str]) -> PinSplit:
    """What each pin keeps in FP32, part by part (ValueError for a pin that names neither part)."""
    whole, estimator, vocoder = False, [], []
    for p in pins:
        if p.startswith(ESTIMATOR + "."):
            estimator.append(p[len(ESTIMATOR) + 1:])
        elif p.startswith("hift."):
            vocoder.append(p[len("hift."):])
        elif p == "hift":
            vocoder.append("*")
        elif any(fnmatch.fnmatchcase(name, p) for name in ("flow", "flow.decoder", ESTIMATOR)):
            whole = True
        else:
            raise ValueError(f"CosyVoice2 FP32 pin {p!r} names no part that runs in FP16: pin flow (the whole "
                             f"solve), or patterns under {ESTIMATOR}. or hift.")
    return PinSplit(whole, tuple(estimator), tuple(vocoder))


@dataclass(frozen=True)
class Speaker:
    """A speaker as the LM and the flow take it (no LM prompt for an SFT or cross-lingual speaker)."""

    prompt_text: torch.Tensor  # [Lt] Qwen2 ids
    llm_prompt_speech: torch.Tensor  # [P] speech tokens
    flow_prompt_tokens: torch.Tensor  # [1, P']
    prompt_mel: torch.Tensor  # [1, 2P', 80]
    embedding: torch.Tensor  # [1, 192]


def _ids(value: Any) -> torch.Tensor:
    return torch.as_tensor(value).reshape(-1).long() if value is not None else torch.zeros(0, dtype=torch.long)


def speaker_from_entry(entry: dict[str, Any], mel_bins: int) -> Speaker:
    """A `spk2info.pt` entry (upstream's keys) as a Speaker; ValueError if it cannot be one."""
    embedding = entry.get("flow_embedding", entry.get("embedding"))
    if embedding is None:
        raise ValueError("a speaker has no embedding ('flow_embedding' or 'embedding')")
    flow_tokens = _ids(entry.get("flow_prompt_speech_token"))
    mel = entry.get("prompt_speech_feat")
    mel = torch.zeros(1, 0, mel_bins) if mel is None else torch.as_tensor(mel).float().reshape(1, -1, mel_bins)
    n = min(mel.shape[1] // 2, flow_tokens.shape[0])  # upstream keeps the mel at two frames a token
    prompt_text, prompt_speech = _ids(entry.get("prompt_text")), _ids(entry.get("llm_prompt_speech_token"))
    if len(prompt_text) > MAX_SENTENCE_TOKENS or len(prompt_speech) > MAX_PROMPT_SPEECH_TOKENS:
        raise ValueError(
            f"a speaker prompt of {len(prompt_text)} text and {len(prompt_speech)} speech tokens; at most "
            f"{MAX_SENTENCE_TOKENS} and {MAX_PROMPT_SPEECH_TOKENS} ({MAX_PROMPT_SPEECH_TOKENS // 25} s) fit the "
            "KV cache: make it again from a shorter recording")
    return Speaker(prompt_text, prompt_speech, flow_tokens[:n][None], mel[:, : 2 * n],
                   torch.as_tensor(embedding).float().reshape(1, -1))


def load_speakers(path: Path, mel_bins: int, embed_dim: int) -> list[Speaker]:
    """`spk2info.pt`'s speakers in name order (`voices.speaker_names`' order); one speaker with
    no prompt and a zero embedding when there is no file."""
    if not path.is_file():
        empty = torch.zeros(0, dtype=torch.long)
        return [Speaker(empty, empty, empty[None], torch.zeros(1, 0, mel_bins), torch.zeros(1, embed_dim))]
    table = torch.load(path, map_location="cpu", weights_only=True)
    out = []
    for name in sorted(str(n) for n in table):
        try:
            out.append(speaker_from_entry(table[name], mel_bins))
        except ValueError as exc:
            raise ConfigError(f"{path}: speaker {name!r}: {exc}") from exc
    return out


class TokenPrior:
    """A sentence's decoder input as a `Prior`: its speech tokens (columns are mel frames; no
    noise drawn by the engine; `key` seeds the vocoder's generator)."""

    def __init__(self, utt: SpeechUtterance) -> None:
        self.utt = utt
        self.key = utt.key
        self.device_values = None
        self.src = np.arange(utt.frames)

    @property
    def mean(self) -> np.ndarray:
        return np.zeros((1, self.frames), dtype=np.float32)

    @property
    def sigma(self) -> np.ndarray:
        return np.zeros((1, self.frames), dtype=np.float32)

    @property
    def frames(self) -> int:
        return self.utt.frames

    @property
    def phonemes(self) -> int:
        return self.utt.frames


@dataclass
class SpeechUtterance:
    """One sentence: its prompt, its speech tokens so far and its place in the KV cache (a
    `service.models.family.DecoderInput`)."""

    text: str
    text_ids: list[int]
    speaker: Speaker
    sid: int | None
    seed: int  # its tokens' draws
    key: int  # the vocoder's generator seed
    sampler: torch.Generator  # seeded with `seed`
    min_tokens: int
    max_tokens: int
    mel_ratio: int
    tokens: list[int] = field(default_factory=list)
    steps: int = 0  # LM steps taken (stop tokens that are not spoken count)
    fed_prompt: bool = False  # the last LM input was the prompt (a stop token other than end of speech after it)
    row: int | None = None  # KV cache row while making tokens
    cached: int = 0  # positions its row holds
    complete: bool = False
    failed: Exception | None = None  # its tokens could not be drawn (the LM's scores)
    word_spans: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def frames(self) -> int:
        return len(self.tokens) * self.mel_ratio

    @property
    def prior(self) -> TokenPrior:
        return TokenPrior(self)


# A captured LM call: the graph, its static inputs (x, rows, lengths) and its output.
LMGraph = tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class GraphedLM:
    """LM calls replayed as CUDA graphs, one per (rows, new positions, span) bucket, each a power
    of two: eagerly a call is hundreds of small kernel launches, whatever the batch. Single-token
    steps have a new-positions bucket of 1; prefills of up to `MAX_PREFILL` rows and positions
    have theirs (longer ones run eagerly: they are bound by arithmetic, not launches). Rows past
    the batch point at the cache's scratch row (its length is reset inside the graph), and the
    span read is the bucket's (the mask hides what lies past each row's length). A graph holds
    the cache's tensors: a grown cache gets a new instance."""

    SMALLEST_SPAN = 64
    SMALLEST_PREFILL = 16
    MAX_PREFILL = (8, 512)  # rows, new positions

    def __init__(self, lm: SpeechLM, cache: KVCache, scratch: int) -> None:
        self.lm, self.cache, self.scratch = lm, cache, scratch
        self.capturer = GraphCapturer(cache.lengths.device)
        self._graphs: GraphTable[tuple[int, int, int], LMGraph] = GraphTable(self.capturer, "the LM's step", self._make)

    def buckets(self, rows: int, new: int, span: int) -> tuple[int, int, int]:
        length = 1 if new == 1 else bucket(new, self.SMALLEST_PREFILL)
        return bucket(rows), length, min(self.cache.capacity, bucket(max(span, length), self.SMALLEST_SPAN))

    def graphed(self, rows: int, new: int) -> bool:
        """Whether a call of `rows` rows of `new` positions replays a graph."""
        most_rows, most_new = self.MAX_PREFILL
        return new == 1 or (rows <= most_rows and new <= most_new)

    def capture(self, rows: int, new: int, span: int) -> None:
        self._graphs.prepare(self.buckets(rows, new, span))

    def _make(self, key: tuple[int, int, int]) -> LMGraph:
        b, t, s = key
        lm, cache, scratch = self.lm, self.cache, self.scratch
        device = cache.lengths.device
        x = torch.zeros(b, t, lm.config.hidden_size, device=device)
        at = torch.full((b,), scratch, dtype=torch.long, device=device)
        lengths = torch.ones(b, dtype=torch.long, device=device)

        def call(x: torch.Tensor, at: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            cache.lengths[scratch : scratch + 1].zero_()
            return lm(x, cache, at, lengths, span=s)

        graph, out = self.capturer.capture(call, x, at, lengths)
        return graph, x, at, lengths, out

    def __call__(self, x: torch.Tensor, rows: torch.Tensor, span: int,
                 lengths: torch.Tensor | None = None) -> torch.Tensor:
        """`SpeechLM.forward(x, cache, rows, lengths, span=span)` for x [B, T, D] (`graphed(B, T)`):
        log-probabilities [B, V]."""
        n, t, _ = x.shape
        key = self.buckets(n, t, span)
        found = self._graphs.get(key, key)
        assert found is not None, "an LM call that cannot be captured raises"
        graph, static_x, static_rows, static_lengths, out = found
        static_x.zero_()
        static_x[:n, :t] = x
        static_rows[:n] = rows
        static_rows[n:] = self.scratch
        static_lengths.fill_(1)
        static_lengths[:n] = t if lengths is None else lengths
        graph.replay()
        return out[:n]


class SpeechTokens:
    """The token stage: a KV cache with a row per sentence making tokens (grown by doubling when
    full), prefill and batched single-token steps (`service.models.family.TokenStage`). On CUDA
    the LM calls replay CUDA graphs (`GraphedLM`); row 0 is their scratch row."""

    SCRATCH = 0

    def __init__(self, model: CosyVoice2, device: torch.device, rows: int = 8) -> None:
        self.lm: SpeechLM = model.lm
        self.token2wav = model.token2wav
        self.sampling = model.config.sampling
        self.device = device
        self.eos = self.lm.config.speech_token_size
        longest_prompt = 2 + 2 * MAX_SENTENCE_TOKENS + MAX_PROMPT_SPEECH_TOKENS  # prompt text + text + speech
        self.capacity = longest_prompt + int(MAX_SENTENCE_TOKENS * LengthLimits().max_ratio)
        self.graphs = device.type == "cuda"
        # On CUDA the stage has a stream of its own, ahead of others in priority: its steps run
        # while a long decoder step occupies the device, and wait only for each other.
        self.stream = own_stream(self, device, priority=-1) if self.graphs else None
        # Made on that stream, as a grown cache is: the caching allocator hands a freed block
        # back to the stream it was made on without waiting for others, so a cache made on the
        # default stream and read on this one could be reused by a decoder step while this
        # stream still copies out of it (when it grows).
        self.free: list[int] = []
        with self._on_stream():
            self._use(KVCache.empty(self.lm.config, rows, self.capacity, device=device), range(rows))

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _use(self, cache: KVCache, new_rows: range) -> None:
        """Serve from `cache`, whose rows `new_rows` are free besides those free already (its own
        graphs: a graph holds the cache it was captured over)."""
        self.cache = cache
        self.free = [r for r in new_rows if not (self.graphs and r == self.SCRATCH)] + self.free
        self._graphed = GraphedLM(self.lm, cache, self.SCRATCH) if self.graphs else None

    def capture(self, rows: int) -> None:
        """The token-step graphs for batches of up to `rows` rows at every span, and the graphs of
        fresh sentences' prefills (CUDA only). The cache is grown first to hold `rows` rows (the
        scratch row among them): a graph holds the cache it was captured over, so a cache grown
        while serving would capture every one of them again, holding every session up."""
        if not self.graphs:
            return
        if rows > len(self.cache.lengths):
            self._grow(rows)
        graphed = self._graphed
        assert graphed is not None
        with torch.inference_mode(), self._on_stream():
            for b in buckets_up_to(rows):
                for span in buckets_up_to(self.capacity, GraphedLM.SMALLEST_SPAN):
                    graphed.capture(b, 1, min(span, self.capacity))
            most_rows, most_new = GraphedLM.MAX_PREFILL
            for b in buckets_up_to(min(rows, most_rows)):
                for new in buckets_up_to(min(most_new, self.capacity), GraphedLM.SMALLEST_PREFILL):
                    graphed.capture(b, new, new)

    def _take_row(self) -> int:
        if not self.free:
            self._grow(2 * len(self.cache.lengths))
        row = self.free.pop()
        self.cache.lengths[row] = 0
        return row

    def _grow(self, rows: int) -> None:
        """A cache of `rows` rows holding this one's, its new rows free."""
        had = len(self.cache.lengths)
        with self._on_stream():
            grown = KVCache.empty(self.lm.config, rows, self.capacity, device=self.device)
            for old, new in zip(self.cache.layers, grown.layers, strict=True):
                new[:, :had] = old
            grown.lengths[:had] = self.cache.lengths
        self._use(grown, range(had, rows))

    def release(self, utt: DecoderInput) -> None:
        """The sentence makes no more tokens (done, or its session ended): give its row back."""
        assert isinstance(utt, SpeechUtterance)
        if utt.row is not None:
            self.free.append(utt.row)
            utt.row = None

    def ready_frames(self, utt: DecoderInput) -> int:
        assert isinstance(utt, SpeechUtterance)
        return ready_frames(self.token2wav, utt)

    def _prompt(self, utt: SpeechUtterance) -> torch.Tensor:
        text = torch.cat([utt.speaker.prompt_text, torch.tensor(utt.text_ids, dtype=torch.long)])
        prompt_speech = utt.speaker.llm_prompt_speech
        # load_speakers and the frontend's sentence cut keep every prompt within the capacity
        assert len(text) + 2 + len(prompt_speech) <= self.capacity - utt.max_tokens
        return self.lm.prompt(to_device(text, self.device), to_device(prompt_speech, self.device))

    @torch.inference_mode()
    def prefill(self, utts: list[SpeechUtterance]) -> None:
        """Each sentence's prompt appended to its row (a fresh one if it has none; one padded
        batch) and its next token drawn."""
        with self._on_stream():
            self._isolated(self._prefill, utts)

    def _prefill(self, utts: list[SpeechUtterance]) -> None:
        prompts = [self._prompt(u) for u in utts]
        for u in utts:
            if u.row is None:
                u.row, u.cached = self._take_row(), 0
        sizes = [p.shape[0] for p in prompts]
        lengths = to_device(sizes, self.device)
        x = torch.zeros(len(utts), max(sizes), self.lm.config.hidden_size, device=self.device)
        for i, p in enumerate(prompts):
            x[i, : p.shape[0]] = p
        for u, p in zip(utts, prompts, strict=True):
            u.cached += p.shape[0]
        self._advance(utts, x, lengths, prompt=True)

    @torch.inference_mode()
    def step(self, rows: Sequence[DecoderInput | None]) -> list[bool | Exception]:
        utts = [u for u in rows if isinstance(u, SpeechUtterance) and not u.complete]
        again = [u for u in utts if u.fed_prompt]  # a stop token right after the prompt: the prompt again, appended
        going = [u for u in utts if not u.fed_prompt]
        self.prefill(again)
        with self._on_stream():
            self._isolated(self._step, going)
        return [u.failed if isinstance(u, SpeechUtterance) and u.failed else
                not isinstance(u, SpeechUtterance) or u.complete for u in rows]

    def _isolated(self, call: Callable[[list[SpeechUtterance]], None], utts: list[SpeechUtterance]) -> None:
        """`call(utts)` (a prefill or a step); if it raises, each sentence goes again alone from
        where it was (its cache row and length), so a fault that one sentence causes fails only
        that one. The draws after the LM call fail their sentence alone (`_draw`), so a raise
        comes before any sentence has drawn."""
        if not utts:
            return
        before = [(u.row, u.cached) for u in utts]
        try:
            call(utts)
        except Exception as exc:
            if len(utts) == 1:
                log.warning("sentence failed in the token stage (%r)", exc)
                self._fail(utts[0], exc)
                return
            log.warning("token stage call of %d sentences failed (%r); each goes again alone", len(utts), exc)
            for u, (row, cached) in zip(utts, before, strict=True):
                if u.row is not None and row is None:  # taken in the call
                    self.free.append(u.row)
                u.row, u.cached = row, cached
                if row is not None:
                    self.cache.lengths[row] = cached
            for u in utts:
                self._isolated(call, [u])

    def _fail(self, u: SpeechUtterance, exc: Exception) -> None:
        """The sentence ends with `exc`; its row is cleared before it is given back: what the
        failed sentence wrote there may not be finite, and a masked position still enters the
        values' weighted sum (0 x NaN), so the row's next sentence would fail too."""
        u.failed, u.complete = exc, True
        if u.row is not None:
            for layer in self.cache.layers:
                layer[:, u.row].zero_()
        self.release(u)

    def _step(self, going: list[SpeechUtterance]) -> None:
        if going:
            last = to_device([u.tokens[-1] for u in going], self.device)
            x = self.lm.speech_embedding(last)[:, None]
            for u in going:
                u.cached += 1
            self._advance(going, x, None, prompt=False)

    def _advance(self, utts: list[SpeechUtterance], x: torch.Tensor, lengths: torch.Tensor | None,
                 prompt: bool) -> None:
        """`x` [B, T, D] appended to the sentences' rows (each one's first `lengths[i]` positions;
        None: all T; `cached` already counts them), then each one's next token drawn. The LM call
        replays a CUDA graph where one covers it."""
        rows = to_device(_row_ids(utts), self.device)
        span = max(u.cached for u in utts)
        graphed = self._graphed
        if graphed is not None and graphed.graphed(len(utts), x.shape[1]):
            logp = graphed(x, rows, span, lengths)
        else:
            logp = self.lm(x, self.cache, rows, lengths, span=span)
        for u, nucleus in zip(utts, nuclei(logp.cpu(), self.sampling), strict=True):
            self._draw(u, nucleus, prompt=prompt)

    def _draw(self, u: SpeechUtterance, nucleus: Nucleus, prompt: bool) -> None:
        """The next token from the LM's scores, as `lm.generate` takes it; a sentence whose
        scores cannot be sampled fails alone."""
        redraw = self.eos if u.steps < u.min_tokens else None
        try:
            token = sample_token(nucleus, u.tokens, self.sampling, u.sampler, redraw=redraw)
        except Exception as exc:
            self._fail(u, exc)
            return
        u.steps += 1
        if token == self.eos:
            u.complete = True
        elif token < self.eos:
            u.tokens.append(token)
            u.fed_prompt = False
        else:
            u.fed_prompt = prompt or u.fed_prompt  # not spoken: the same input again
        if u.steps >= u.max_tokens:
            u.complete = True
        if u.complete:
            self.release(u)


def _row_ids(utts: list[SpeechUtterance]) -> list[int]:
    """The cache rows the sentences hold (every one has its row by then)."""
    rows = []
    for u in utts:
        assert u.row is not None
        rows.append(u.row)
    return rows


def ready_frames(token2wav: Token2Wav, utt: SpeechUtterance) -> int:
    """Frames of `utt`'s audio that can be made now: all of them once its tokens are complete,
    else what the streaming chunks before the last make."""
    if utt.complete:
        return utt.frames
    return token2wav.streamable_frames(utt.speaker.flow_prompt_tokens.shape[1], len(utt.tokens))


@dataclass
class _Slot:
    utt: SpeechUtterance
    state: Token2WavState
    tokens: torch.Tensor
    audio: torch.Tensor  # [samples] made so far


class TokenAudioSlots:
    """The slot decoder (`service.models.family.StreamingDecoder`): each slot streams its
    sentence through `Token2Wav` as the steps reach its audio (a chunk is made when a step needs
    audio past what is made), and each step hands out the next frames of each row's audio."""

    lag = 0

    def __init__(self, runtime: CosyVoice2Runtime, precision: str, slots: int) -> None:
        self.runtime, self.precision, self.capacity = runtime, precision, slots
        self.hop = runtime.hop
        self.step_seconds: dict[tuple[int, int], float] = {}
        self.token2wav = runtime.token2wav(precision)
        self._slots: dict[int, _Slot] = {}

    def start(self, slot: int, prior: Prior) -> bool:
        assert isinstance(prior, TokenPrior), "a CosyVoice2 voice decodes its own speech tokens"
        self._slots[slot] = self._fresh(prior.utt)
        return True

    def _fresh(self, utt: SpeechUtterance) -> _Slot:
        return _Slot(utt, self.runtime.stream_state(utt, self.precision),
                     to_device([utt.tokens], self.runtime.device, torch.long),
                     torch.zeros(0, device=self.runtime.device))

    def free(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def capture_all(self) -> None:
        """No CUDA graphs yet: chunk shapes vary with each sentence's prompt and tokens."""

    @torch.inference_mode()
    def step(self, rows: StepRows) -> torch.Tensor:
        """Rows whose audio falls short of the step make their next chunk together: one batched
        flow call per round (chunks and last chunks in one solve), then the vocoder over the rows
        whose input is as long (no padding: its convolutions would see it), until every row has its
        span."""
        size = rows.frames * self.hop
        short = {}
        for slot, fed in zip(rows.slots, rows.fed, strict=True):
            s = self._slots[slot]
            if s.tokens.shape[1] != len(s.utt.tokens):  # made while its tokens are being made
                s.tokens = to_device([s.utt.tokens], self.runtime.device, torch.long)
            ready = ready_frames(self.token2wav, s.utt)
            short[slot] = (s, min(ready * self.hop, (fed + rows.frames) * self.hop))
        while pending := [s for s, end in short.values() if s.audio.shape[0] < end and not s.state.done]:
            if not self._chunks(pending):
                raise RuntimeError("a step asked for audio past what the sentence's tokens so far can make")
        dtype = torch.float16 if self.precision == "fp16" else torch.float32
        out = torch.zeros(len(rows.slots), size, device=self.runtime.device, dtype=dtype)
        for row, (slot, fed) in enumerate(zip(rows.slots, rows.fed, strict=True)):
            piece = self._slots[slot].audio[fed * self.hop : fed * self.hop + size]
            out[row, : piece.shape[0]] = piece
        return out

    def _chunks(self, slots: list[_Slot]) -> int:
        """The next chunk of each slot's audio (a final chunk where too few tokens are left and
        they are complete); how many slots made one."""
        t2w = self.token2wav
        group, finals = [], []
        for s in slots:
            final = not t2w.ready(s.state, s.tokens.shape[1])
            if final and not s.utt.complete:
                continue  # the last chunk waits for the last token
            group.append(s)
            finals.append(final)
        if not group:
            return 0
        requests = [t2w.request(s.state, s.tokens, final) for s, final in zip(group, finals, strict=True)]
        mels = t2w.flow.batch(requests, streaming=[not final for final in finals], finalize=finals)
        for s, audio in zip(group, t2w.vocode_batch([s.state for s in group], mels, finals), strict=True):
            s.audio = torch.cat([s.audio, audio[0].float()])
        return len(group)


_MODELS: dict[tuple[str, str], CosyVoice2] = {}
_MODELS_LOCK = threading.Lock()


def shared_model(directory: Path, device: str) -> CosyVoice2:
    """One loaded model per directory and device."""
    key = (str(directory.resolve()), device)
    with _MODELS_LOCK:
        model = _MODELS.get(key)
        if model is None:
            model = load_model(directory)
            model.lm.to(device)
            model.flow.to(device)
            model.hift.to(device)
            _MODELS[key] = model
    return model


class CosyVoice2Runtime:
    """A CosyVoice2 directory on torch for one engine thread: FP32, and on CUDA FP16 decoding
    with FP32 pins (the LM runs in FP32)."""

    backend_name = "torch"
    pin_candidates = COSYVOICE2_PIN_CANDIDATES

    def __init__(self, info: VoiceInfo, device: str, schedule: ChunkSchedule | None = None,
                 pins: tuple[str, ...] = COSYVOICE2_FP32_PINS, compile_flow: bool = False) -> None:
        """`compile_flow`: on CUDA, the flow's estimator through torch.compile under its graphs."""
        self.info = info
        self.device = torch.device(device)
        self.capabilities = Capabilities(slot_decoder=True, asynchronous=self.device.type == "cuda")
        self.schedule = schedule or ChunkSchedule()
        self.model = shared_model(info.model_path, device)
        config = self.model.config
        self.speakers = load_speakers(info.model_path / SPEAKERS_FILE, config.flow.output_size,
                                      config.flow.spk_embed_dim)
        self.fp32_pins = tuple(pins)
        self._pins = split_pins(self.fp32_pins)  # a pin naming nothing fails here, at load
        self.limits = LengthLimits()
        self._tokens = SpeechTokens(self.model, self.device)
        self._audio: dict[str, Token2Wav] = {}
        self._solver = self.model.flow.use_graphs(compiled=compile_flow) if self.device.type == "cuda" else None
        if compile_flow and self._solver is None:
            log.info("compiling the decoder applies to CUDA only: the flow runs eagerly on %s", self.device)

    @property
    def sample_rate(self) -> int:
        return self.info.sample_rate

    @property
    def hop(self) -> int:
        return self.model.hift.config.samples_per_frame

    @property
    def tokens(self) -> SpeechTokens:
        return self._tokens

    def precisions(self) -> tuple[str, ...]:
        """FP16 decoding on any device (on the CPU for tests: the engine's automatic choice there is FP32)."""
        return ("fp32", "fp16")

    def token2wav(self, precision: str) -> Token2Wav:
        """The streaming token-to-audio stage in `precision` (FP16: a pinned twin of the vocoder
        and, unless `flow` is pinned, of the estimator; made once)."""
        if precision not in self.precisions():
            raise ValueError(f"CosyVoice2 on {self.device.type} runs {' or '.join(self.precisions())}, not {precision}")
        found = self._audio.get(precision)
        if found is None:
            model = self.model
            if precision == "fp32":
                found = model.token2wav
            else:
                hift = to_mixed_precision(model.hift, self._pins.vocoder, torch.float16)
                for name in FP32_STAGES:  # FP32, outputs too
                    setattr(hift, name, getattr(model.hift, name))
                flow = model.flow
                if not self._pins.estimator_fp32:
                    half = to_mixed_precision(flow.decoder.estimator, self._pins.estimator, torch.float16)
                    flow = flow.with_estimator(HalfEstimator(half))
                    if self._solver is not None:  # its own graphs in the FP32 ones' memory: never at once
                        flow.use_graphs(self._solver.capturer, self._solver.compiled)
                found = Token2Wav(flow, hift, model.config.stream)
            self._audio[precision] = found
        return found

    def stream_state(self, utt: SpeechUtterance, precision: str) -> Token2WavState:
        """A fresh streaming state for `utt`: its speaker's flow prompt, its vocoder generator."""
        generator = torch.Generator(device=self.device).manual_seed(utt.key)
        sp = utt.speaker
        return Token2WavState(generator, to_device(sp.flow_prompt_tokens, self.device),
                              to_device(sp.prompt_mel, self.device), to_device(sp.embedding, self.device))

    # Flow solves, encoder and vocoder calls captured before serving (larger ones are captured when
    # first seen, holding every session up meanwhile): rows as a step of a few dozen sessions' chunks
    # reaches; frames and tokens as sentences of a trained model's length do.
    PREPARED_ROWS = 32
    PREPARED_FRAMES = 1024  # mel frames of a solve (the prompt's too)
    PREPARED_ENCODES = 512  # tokens of an encoder call (with the prompt's)
    # KV-cache rows (the scratch row among them) whose token steps are captured before serving:
    # sentences making tokens at once, beyond which the cache grows and its graphs are captured anew.
    PREPARED_TOKEN_ROWS = 64

    def prepare(self, max_batch: int) -> None:
        """On CUDA, the CUDA graphs of the token steps over a cache of `PREPARED_TOKEN_ROWS`, of the flow's
        encoder calls up to `PREPARED_ROWS` x `PREPARED_ENCODES` and solves up to `PREPARED_ROWS`
        x `PREPARED_FRAMES` (the FP16 estimator's too, where it runs), and of the vocoder's
        streaming calls up to `PREPARED_ROWS` (FP32 and FP16) for the saved speakers' prompts."""
        self._tokens.capture(self.PREPARED_TOKEN_ROWS)
        if self._solver is None:
            return
        solvers = [self._solver]
        if not self._pins.estimator_fp32:
            half = self.token2wav("fp16").flow.graphed
            assert half is not None
            solvers.append(half)
        rows, frames = self.PREPARED_ROWS, self.PREPARED_FRAMES
        prompts = [sp.flow_prompt_tokens.shape[1] for sp in self.speakers]
        with torch.inference_mode():
            for solver in solvers:
                for b in buckets_up_to(rows):
                    for t in buckets_up_to(frames, solver.SMALLEST_FRAMES):
                        solver.capture(b, t)
            encoder = self.model.flow.graphed_encoder
            assert encoder is not None
            lookahead = self.model.flow.config.encoder.pre_lookahead_len
            for b in buckets_up_to(rows):
                for t in buckets_up_to(self.PREPARED_ENCODES, encoder.SMALLEST_TOKENS):
                    encoder.capture(b, t, True, lookahead)  # a chunk
                    encoder.capture(b, t, False, 0)  # the last chunk
            for precision in self.precisions():
                t2w = self.token2wav(precision)
                t2w.use_graphs(self._solver.capturer)
                t2w.capture_vocoder(rows, prompts)

    def acoustic_batch(self, jobs: list[AcousticJob]) -> Sequence[DecoderInput]:
        """Each sentence's LM prompt prefilled (one padded batch) and its first token drawn."""
        utts = []
        for job in jobs:
            if job.params.length_scale not in (None, 1.0):
                raise ValueError("CosyVoice2 voices speak at their own pace: leave the speaking rate at its default")
            speaker = (self.speakers[job.sid or 0] if job.prompt is None
                       else speaker_from_entry(job.prompt, self.model.config.flow.output_size))
            n_text = len(job.sentence.phoneme_ids)
            seed, key = (int(v) for v in job.rng.integers(0, 1 << 62, size=2))
            utts.append(SpeechUtterance(
                job.sentence.text, list(job.sentence.phoneme_ids), speaker, job.sid, seed, key,
                torch.Generator().manual_seed(seed), int(n_text * self.limits.min_ratio),
                int(n_text * self.limits.max_ratio), self.model.token2wav.mel_ratio))
        self._tokens.prefill(utts)
        out: list[DecoderInput] = list(utts)
        return out

    def streaming_decoder(self, precision: str, slots: int, *, max_rows: int, graphs: bool,
                          graph_frames: tuple[int, ...]) -> TokenAudioSlots:
        self.token2wav(precision)  # an unsupported precision fails here, before serving
        return TokenAudioSlots(self, precision, slots)

    def streaming_lag(self) -> int:
        return TokenAudioSlots.lag

    def utterance_decoder(self, utt: DecoderInput, precision: str) -> UtteranceDecoder:
        raise ValueError("CosyVoice2 voices decode through their slot decoder (--decoder auto or slots)")

    @torch.inference_mode()
    def reference(self, utt: DecoderInput, precision: str = "fp32") -> np.ndarray:
        """The sentence's audio as upstream's streaming path makes it, every chunk at once (the
        streamed audio is not a full-context decode: the flow's chunk masks differ)."""
        assert isinstance(utt, SpeechUtterance), "a CosyVoice2 voice decodes its own speech tokens"
        decoder = TokenAudioSlots(self, precision, 1)
        slot = decoder._fresh(utt)
        while not slot.state.done:
            decoder._chunks([slot])
        return slot.audio.cpu().numpy()

    def guard_async(self, device_audio: Any) -> PendingAudio:
        from service.models.device_audio import guard_async

        return guard_async(device_audio)
