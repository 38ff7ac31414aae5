"""Streaming tokens to audio as upstream's CosyVoice2 does it: every `token_hop_len` new tokens
(plus the 3-token lookahead), the flow runs again over all tokens so far with chunk masks and the
new frames are vocoded; the vocoder's last 8 mel frames and their excitation are kept and the
next chunk starts from them, its first 8 frames' audio cross-faded (Hamming) with the previous
chunk's held-back tail. The last call runs the flow at full context over every token.

`Token2WavState` is one utterance's; the session owns it (and the vocoder's random generator), so
many utterances can stream through one `Token2Wav` at once."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from service.models.cosyvoice2.flow import Flow, FlowRequest, per_row
from service.models.cosyvoice2.hift import GraphedHiFT, HiFT
from service.models.cuda_graphs import GraphCapturer, buckets_up_to


@dataclass(frozen=True)
class StreamConfig:
    token_hop_len: int = 25  # tokens per chunk: the flow's static chunk (training's)
    mel_cache_len: int = 8  # vocoder frames carried into the next chunk


@dataclass
class Token2WavState:
    """One utterance's progress: tokens already turned into audio, and the vocoder cache."""

    generator: torch.Generator
    prompt_tokens: torch.Tensor  # [1, P]
    prompt_mel: torch.Tensor  # [1, P', 80]
    embedding: torch.Tensor  # [1, 192]
    token_offset: int = 0
    cache_mel: torch.Tensor | None = None
    cache_source: torch.Tensor | None = None
    cache_speech: torch.Tensor | None = None
    done: bool = field(default=False)


class Token2Wav:
    def __init__(self, flow: Flow, hift: HiFT, config: StreamConfig | None = None) -> None:
        self.flow, self.hift = flow, hift
        self.config = config or StreamConfig()
        self.mel_ratio = flow.config.encoder.up_stride
        self.lookahead = flow.config.encoder.pre_lookahead_len
        self.source_cache_len = self.config.mel_cache_len * hift.config.samples_per_frame
        self.window = _hamming(2 * self.source_cache_len)
        self.graphed: GraphedHiFT | None = None

    def use_graphs(self, capturer: GraphCapturer) -> GraphedHiFT:
        """Vocode through CUDA graphs from now on where a call's shape was captured
        (`capture_vocoder`); `capturer`: the flow's, whose graphs never run at the same time."""
        if self.graphed is None:
            self.graphed = GraphedHiFT(self.hift, capturer)
        return self.graphed

    def capture_vocoder(self, rows: int, prompts: Iterable[int]) -> None:
        """The vocoder graphs of streaming calls of up to `rows` rows: every chunk but the first
        and the last (their frames and cache are always the same), and the first chunk after a
        prompt of each length in `prompts` (tokens)."""
        graphed = self.graphed
        assert graphed is not None, "use_graphs first"
        steady = self.config.mel_cache_len + self.config.token_hop_len * self.mel_ratio
        for b in buckets_up_to(rows):
            graphed.capture(b, steady, self.source_cache_len)
            for prompt in sorted(set(prompts)):
                graphed.capture(b, self._hop(prompt, 0) * self.mel_ratio, 0)

    def hop(self, state: Token2WavState) -> int:
        return self._hop(state.prompt_tokens.shape[1], state.token_offset)

    def _hop(self, prompt: int, offset: int) -> int:
        """Tokens the next chunk turns into audio: the first chunk also rounds the prompt's
        tokens up to a whole chunk, so every chunk boundary falls on the flow's chunk grid."""
        hop = self.config.token_hop_len
        if offset:
            return hop
        return hop + math.ceil(prompt / hop) * hop - prompt

    def streamable_frames(self, prompt: int, tokens: int) -> int:
        """Mel frames of audio the chunks before the last can make from `tokens` tokens so far
        (after a prompt of `prompt` tokens): each chunk's audio but its held-back tail."""
        first, hop = self._hop(prompt, 0), self.config.token_hop_len
        if tokens < first + self.lookahead:
            return 0
        offset = first + (tokens - first - self.lookahead) // hop * hop  # the first chunk, then whole hops
        return offset * self.mel_ratio - self.config.mel_cache_len

    def ready(self, state: Token2WavState, tokens: int) -> bool:
        """Can a chunk (not the last) be made from `tokens` tokens so far?"""
        return tokens - state.token_offset >= self.hop(state) + self.lookahead

    def chunk(self, state: Token2WavState, tokens: torch.Tensor, finalize: bool) -> torch.Tensor:
        """Audio [1, samples] for the next chunk of `tokens` [1, T] (all tokens so far). Not
        `finalize`: only when `ready`, and the chunk's last `source_cache_len` samples are held
        back for the cross-fade; `finalize`: everything left."""
        r = self.request(state, tokens, finalize)
        mel = self.flow(r.tokens, r.prompt_tokens, r.prompt_mel, r.embedding, streaming=not finalize,
                        finalize=finalize)
        return self.vocode(state, mel, finalize)

    def request(self, state: Token2WavState, tokens: torch.Tensor, finalize: bool) -> FlowRequest:
        """The flow call the next chunk needs (`Flow.batch` runs many sessions' at once)."""
        if state.done:
            raise ValueError("this utterance's last chunk was already made")
        if not finalize:
            hop = self.hop(state)
            if not self.ready(state, tokens.shape[1]):
                raise ValueError(f"a chunk needs {hop + self.lookahead} tokens past the offset; "
                                 f"{tokens.shape[1] - state.token_offset} are")
            tokens = tokens[:, :state.token_offset + hop + self.lookahead]
        return FlowRequest(tokens, state.prompt_tokens, state.prompt_mel, state.embedding)

    def vocode(self, state: Token2WavState, mel: torch.Tensor, finalize: bool) -> torch.Tensor:
        """The chunk's audio from the flow's mel for its request (all frames after the prompt)."""
        return self.vocode_batch([state], [mel], finalize)[0]

    def vocode_batch(self, states: Sequence[Token2WavState], mels: Sequence[torch.Tensor],
                     finalize: bool | Sequence[bool]) -> list[torch.Tensor]:
        """Several utterances' chunks through the vocoder: rows whose input is as long (and that
        all carry, or all lack, a cache) share a call, each drawing from its own generator as
        alone; its convolutions see no padding, so each row's audio is its audio alone.
        `finalize`: every chunk's, or each chunk's (is it its utterance's last)."""
        finals = per_row(finalize, len(states))
        inputs = []
        for state, mel in zip(states, mels, strict=True):
            mel = mel[:, :, state.token_offset * self.mel_ratio:]
            inputs.append(mel if state.cache_mel is None else torch.cat([state.cache_mel, mel], dim=2))
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, (state, mel) in enumerate(zip(states, inputs, strict=True)):
            groups.setdefault((mel.shape[2], state.cache_source is not None), []).append(i)
        out: dict[int, torch.Tensor] = {}
        for (_, cached), rows in groups.items():
            caches = [c for i in rows if (c := states[i].cache_source) is not None]
            cache = torch.cat(caches) if cached else None
            vocoder = self.graphed or self.hift
            speech, source = vocoder(torch.cat([inputs[i] for i in rows]), [states[i].generator for i in rows], cache)
            for j, i in enumerate(rows):
                out[i] = self._finish(states[i], inputs[i], speech[j : j + 1], source[j : j + 1], finals[i])
        return [out[i] for i in range(len(states))]

    def _finish(self, state: Token2WavState, mel: torch.Tensor, speech: torch.Tensor, source: torch.Tensor,
                finalize: bool) -> torch.Tensor:
        """Cross-fade with the previous chunk's tail; keep this chunk's tail and caches."""
        hop = self.hop(state)
        if state.cache_speech is not None:
            speech = self._cross_fade(speech, state.cache_speech)
        if finalize:
            state.done = True
            return speech
        n = self.source_cache_len
        state.cache_mel = mel[:, :, -self.config.mel_cache_len:]
        state.cache_source = source[:, :, -n:]
        state.cache_speech = speech[:, -n:]
        state.token_offset += hop
        return speech[:, :-n]

    def _cross_fade(self, speech: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """The chunk's first samples faded in over the previous chunk's held-back tail (window
        products in float64, as upstream's NumPy window makes them)."""
        if self.window.device != speech.device:
            self.window = self.window.to(speech.device)
        n = self.window.shape[0] // 2
        out = speech.clone()
        head = speech[..., :n].double() * self.window[:n] + previous[..., -n:].double() * self.window[n:]
        out[..., :n] = head.to(speech.dtype)
        return out


def _hamming(length: int) -> torch.Tensor:
    """Symmetric Hamming window in float64 (NumPy's `hamming`)."""
    n = torch.arange(length, dtype=torch.float64)
    return 0.54 - 0.46 * torch.cos(2 * math.pi * n / (length - 1))
