"""CosyVoice2's token-to-mel flow: speech tokens (after the prompt's) through the token encoder to
the mel rate, projected to 80 bands as the flow's condition mu; the speaker embedding (normalised,
projected to 80) and the prompt's mel condition the solver; the prompt's frames are cut from the
result. Module names follow the official `CausalMaskedDiffWithXvec`, so `flow.pt` loads as it is."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from service.models.cosyvoice2.cfm import CfmConfig, GraphedSolve, fixed_noise, solve
from service.models.cosyvoice2.encoder import EncoderConfig, TokenEncoder
from service.models.cosyvoice2.estimator import Estimator, EstimatorConfig
from service.models.cuda_graphs import GraphCapturer, GraphTable, bucket
from service.models.transfer import to_device


@dataclass(frozen=True)
class FlowConfig:
    """`flow` in cosyvoice2.yaml (CosyVoice2-0.5B's values as defaults)."""

    vocab_size: int = 6561
    output_size: int = 80
    spk_embed_dim: int = 192
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    cfm: CfmConfig = field(default_factory=CfmConfig)


class _Decoder(nn.Module):
    """Holds the estimator under upstream's name (`decoder.estimator`)."""

    def __init__(self, estimator: nn.Module) -> None:
        super().__init__()
        self.estimator = estimator


class HalfEstimator(nn.Module):
    """An FP16 estimator (its pinned modules FP32) inside an FP32 solve: the Euler state, the
    guidance mix and the time embedding stay FP32; each pass takes its tensors in FP16 and hands
    its velocity back in FP32, so rounding does not pile up over the steps."""

    def __init__(self, estimator: nn.Module) -> None:
        super().__init__()
        self.estimator = estimator

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor, cond: torch.Tensor, streaming: bool | torch.Tensor = False) -> torch.Tensor:
        h = torch.float16
        return self.estimator(x.to(h), mask.to(h), mu.to(h), t, spks.to(h), cond.to(h), streaming=streaming).float()


@dataclass(frozen=True)
class FlowRequest:
    """One utterance's flow call: its tokens so far [1, T] after its prompt's."""

    tokens: torch.Tensor
    prompt_tokens: torch.Tensor  # [1, P]
    prompt_mel: torch.Tensor  # [1, P', 80]
    embedding: torch.Tensor  # [1, 192]


class Flow(nn.Module):
    def __init__(self, config: FlowConfig) -> None:
        super().__init__()
        self.config = config
        size = config.encoder.size
        self.input_embedding = nn.Embedding(config.vocab_size, size)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.output_size)
        self.encoder = TokenEncoder(config.encoder)
        self.encoder_proj = nn.Linear(size, config.output_size)
        self.decoder = _Decoder(Estimator(config.estimator))
        self.noise: torch.Tensor
        self.register_buffer("noise", fixed_noise(config.cfm), persistent=False)
        self.graphed: GraphedSolve | None = None
        self.graphed_encoder: GraphedEncoder | None = None

    def use_graphs(self, capturer: GraphCapturer | None = None, compiled: bool = False) -> GraphedSolve:
        """Encode and solve through CUDA graphs from now on (the flow on a CUDA device, FP32
        inputs). `capturer`: another flow's, to share its graphs' memory (flows that never run at
        once); `compiled`: the estimator through torch.compile under them (`GraphedSolve`)."""
        if self.graphed is None:
            self.graphed = GraphedSolve(self.decoder.estimator, self.noise, self.config.cfm, capturer, compiled)
        if self.graphed_encoder is None:
            self.graphed_encoder = GraphedEncoder(self, self.graphed.capturer)
        return self.graphed

    def with_estimator(self, estimator: nn.Module) -> Flow:
        """A flow that shares every module and buffer of this one but solves with `estimator`
        (an FP16 twin beside the FP32 flow costs only the estimator's weights); no solve graphs
        yet (the encoder's are shared)."""
        twin = copy.copy(self)
        twin._modules = dict(self._modules)
        twin.decoder = _Decoder(estimator)
        twin.graphed = None
        return twin

    def _solve(self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
               streaming: bool | torch.Tensor) -> torch.Tensor:
        if self.graphed is not None and mu.dtype == torch.float32:
            return self.graphed(mu, mask, spks, cond, streaming)
        return solve(self.decoder.estimator, self.noise, mu, mask, spks, cond, self.config.cfm, streaming=streaming)

    def speaker(self, embedding: torch.Tensor) -> torch.Tensor:
        """A speaker embedding [B, 192] (CAM++ x-vector) as the solver's condition [B, 80]."""
        return self.spk_embed_affine_layer(F.normalize(embedding, dim=1))

    def mu(self, tokens: torch.Tensor, finalize: bool, streaming: bool) -> torch.Tensor:
        """Encoder condition [1, 80, 2 * T'] for one utterance's tokens [1, T] (prompt tokens
        first). Not `finalize`: the last `pre_lookahead_len` tokens are only the lookahead of the
        others (their frames come with the next chunk)."""
        x = self.input_embedding(torch.clamp(tokens, min=0))
        context = None
        if not finalize:
            k = self.config.encoder.pre_lookahead_len
            x, context = x[:, :-k], x[:, -k:]
        h, _ = self.encoder(x, [x.shape[1]], context=context, streaming=streaming)
        return self.encoder_proj(h).transpose(1, 2)

    def batch(self, requests: Sequence[FlowRequest], streaming: bool | Sequence[bool],
              finalize: bool | Sequence[bool]) -> list[torch.Tensor]:
        """Several utterances' calls at once (each row as alone, to kernel rounding: padding is
        masked everywhere and each row's lookahead context follows its own last token) -> each
        one's mel [1, 80, frames]. `streaming` and `finalize`: every call's, or each call's: rows
        of each kind are encoded together, and all rows share one solve (its mode per row)."""
        n = len(requests)
        modes = list(zip(per_row(streaming, n), per_row(finalize, n), strict=True))
        if n == 1 and self.graphed_encoder is None:
            r, (stream, final) = requests[0], modes[0]
            return [self(r.tokens, r.prompt_tokens, r.prompt_mel, r.embedding, streaming=stream, finalize=final)]
        lookahead = self.config.encoder.pre_lookahead_len
        full = [torch.cat([r.prompt_tokens, r.tokens], dim=1)[0] for r in requests]
        sizes = [f.shape[0] - (0 if final else lookahead) for f, (_, final) in zip(full, modes, strict=True)]
        groups: dict[tuple[bool, bool], list[int]] = {}
        for i, mode in enumerate(modes):
            groups.setdefault(mode, []).append(i)
        encoded = []
        for (stream, final), rows in groups.items():
            k = 0 if final else lookahead
            part = ([full[i] for i in rows], [sizes[i] for i in rows], k, stream)
            encoded.append(self.graphed_encoder(*part) if self.graphed_encoder is not None else self.encode(*part))
        if len(groups) == 1:
            mu, frames = encoded[0]
        else:  # the groups' rows back in the requests' order, padded to the longest
            span = max(m.shape[2] for m, _ in encoded)
            mu = torch.zeros(n, self.config.output_size, span, device=encoded[0][0].device, dtype=encoded[0][0].dtype)
            frames = torch.zeros(n, dtype=encoded[0][1].dtype, device=mu.device)
            for rows, (m, f) in zip(groups.values(), encoded, strict=True):
                index = to_device(rows, mu.device)
                mu[index, :, : m.shape[2]] = m
                frames[index] = f
        span = mu.shape[2]
        valid = torch.arange(span, device=mu.device)[None, :] < frames[:, None]
        mu = mu * valid[:, None].to(mu.dtype)
        cond = torch.zeros(n, self.config.output_size, span, device=mu.device, dtype=mu.dtype)
        for i, r in enumerate(requests):
            cond[i, :, : r.prompt_mel.shape[1]] = r.prompt_mel[0].T
        spks = self.speaker(torch.cat([r.embedding for r in requests]))
        streams = [stream for stream, _ in modes]
        rows_streaming: bool | torch.Tensor = (streams[0] if len(set(streams)) == 1
                                               else to_device(streams, mu.device, torch.bool))
        mel = self._solve(mu, valid[:, None].to(mu.dtype), spks, cond, rows_streaming)
        up = self.config.encoder.up_stride
        return [mel[i : i + 1, :, r.prompt_mel.shape[1] : size * up]
                for i, (r, size) in enumerate(zip(requests, sizes, strict=True))]

    def encode(self, full: Sequence[torch.Tensor], sizes: Sequence[int] | torch.Tensor, k: int,
               streaming: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The condition mu [B, 80, 2T] and each row's frames [B] for rows of token ids `full`
        (prompt tokens first), each row's first `sizes[i]` through the encoder and, with `k`,
        its last `k` as their lookahead (rows padded to the longest)."""
        top = max(f.shape[0] for f in full) - k
        ids = torch.zeros(len(full), top, dtype=torch.long, device=full[0].device)
        for i, f in enumerate(full):
            ids[i, : f.shape[0] - k] = f[: f.shape[0] - k]
        return self.encode_ids(ids, sizes, torch.stack([f[-k:] for f in full]) if k else None, streaming)

    def encode_ids(self, ids: torch.Tensor, sizes: Sequence[int] | torch.Tensor, context: torch.Tensor | None,
                   streaming: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`encode` for padded ids [B, T] and the lookahead's ids [B, k] (or None)."""
        x = self.input_embedding(torch.clamp(ids, min=0))
        ahead = None if context is None else self.input_embedding(torch.clamp(context, min=0))
        h, frames = self.encoder(x, sizes, context=ahead, streaming=streaming)
        return self.encoder_proj(h).transpose(1, 2), frames

    def forward(self, tokens: torch.Tensor, prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor,
                embedding: torch.Tensor, streaming: bool = False, finalize: bool = True) -> torch.Tensor:
        """Mel [1, 80, frames] for `tokens` [1, T] after the prompt (prompt_tokens [1, P],
        prompt_mel [1, P', 80] its mel, embedding [1, 192] the speaker)."""
        spks = self.speaker(embedding)
        mu = self.mu(torch.cat([prompt_tokens, tokens], dim=1), finalize, streaming)
        frames = mu.shape[2]
        prompt_frames = prompt_mel.shape[1]
        cond = torch.zeros(1, frames, self.config.output_size, device=mu.device, dtype=mu.dtype)
        cond[:, :prompt_frames] = prompt_mel
        mask = torch.ones(1, 1, frames, device=mu.device, dtype=mu.dtype)
        mel = self._solve(mu, mask, spks, cond.transpose(1, 2), streaming)
        return mel[:, :, prompt_frames:]


# A captured encoder call: the graph, its static inputs (ids, lengths[, lookahead ids]) and its
# outputs (mu, frames).
EncoderGraph = tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]


class GraphedEncoder:
    """The flow's encoder calls (token ids to the condition mu) replayed as CUDA graphs, one per
    (rows, tokens) bucket (powers of two) and mode: eagerly a call is hundreds of small kernel
    launches. Rows are padded with tokens the mask hides, as in a batch of unequal rows; rows
    past the batch are all valid zero tokens (finite, unread). A call that cannot be captured
    runs eagerly."""

    SMALLEST_TOKENS = 64

    def __init__(self, flow: Flow, capturer: GraphCapturer) -> None:
        self.flow, self.capturer = flow, capturer
        self._graphs: GraphTable[tuple[int, int, bool, int], EncoderGraph] = GraphTable(
            capturer, "the flow's encoder", self._make)

    def buckets(self, rows: int, tokens: int) -> tuple[int, int]:
        return bucket(rows), bucket(tokens, self.SMALLEST_TOKENS)

    def capture(self, rows: int, tokens: int, streaming: bool, lookahead: int) -> None:
        """The graph for calls of `rows` rows of at most `tokens` tokens each (their buckets),
        with `lookahead` tokens of context after each row (0: none)."""
        self._graphs.prepare((*self.buckets(rows, tokens), streaming, lookahead))

    def _make(self, key: tuple[int, int, bool, int]) -> EncoderGraph | None:
        b, t, streaming, lookahead = key
        flow, dev = self.flow, self.capturer.device
        static: tuple[torch.Tensor, ...] = (torch.zeros(b, t, dtype=torch.long, device=dev),
                                            torch.full((b,), t, dtype=torch.long, device=dev))
        if lookahead:
            static += (torch.zeros(b, lookahead, dtype=torch.long, device=dev),)

        def run(ids: torch.Tensor, lengths: torch.Tensor,
                context: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            return flow.encode_ids(ids, lengths, context, streaming)

        captured = self.capturer.capture_or_none(self._graphs.what, run, *static)
        return None if captured is None else (captured[0], static, captured[1])

    def __call__(self, full: Sequence[torch.Tensor], sizes: Sequence[int], lookahead: int,
                 streaming: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`Flow.encode(full, sizes, lookahead, streaming)`, padded to the call's buckets."""
        b, top = len(full), max(sizes)
        key = (*self.buckets(b, top), streaming, lookahead)
        found = self._graphs.get(key, key[:2])
        if found is None:
            return self.flow.encode(full, sizes, lookahead, streaming)
        graph, static, (mu, frames) = found
        ids, lengths = static[0], static[1]
        ids.zero_()
        lengths.fill_(ids.shape[1])
        for i, (f, n) in enumerate(zip(full, sizes, strict=True)):
            ids[i, :n] = f[:n]
        lengths[:b] = to_device(list(sizes), ids.device)
        if lookahead:
            static[2][:b] = torch.stack([f[-lookahead:] for f in full])
        graph.replay()
        # Copies: the next replay writes the outputs again.
        return mu[:b, :, : top * self.flow.config.encoder.up_stride].clone(), frames[:b].clone()


def per_row(value: bool | Sequence[bool], rows: int) -> list[bool]:
    """A mode given once for every call, or each call's, as a list of each call's."""
    if isinstance(value, bool):
        return [value] * rows
    if len(value) != rows:
        raise ValueError(f"{len(value)} modes for {rows} calls")
    return list(value)


def load_flow(config: FlowConfig, official: Mapping[str, torch.Tensor]) -> Flow:
    model = Flow(config)
    model.load_state_dict(dict(official), strict=True)
    return model.eval()
