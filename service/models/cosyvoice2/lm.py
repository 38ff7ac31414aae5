"""CosyVoice2's speech-token LM: a Qwen2 decoder (pre-norm, grouped-query attention with rotary
positions, SwiGLU MLP) that reads the prompt as embeddings and writes 25 Hz speech tokens.

The input is [sos, text tokens (the Qwen2 vocabulary), task id, prompt speech tokens]; each
step's last hidden state goes through `llm_decoder` to scores over the speech vocabulary plus
three stop tokens, and the chosen token's `speech_embedding` is the next input. Loads the
official `llm.pt` state dict (`Qwen2LM` around `Qwen2ForCausalLM`) by its names.

The attention reads and writes a KV cache the caller owns (`KVCache`): one row per session, so a
step over many sessions is one batched call (the engine's continuous batching)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from service.models.stacked import stack_linears


@dataclass(frozen=True)
class Qwen2Config:
    """The Qwen2 backbone (`config.json` of the official tokenizer folder; CosyVoice2-0.5B's
    values as defaults) and the speech vocabulary around it (`llm` in cosyvoice2.yaml)."""

    hidden_size: int = 896
    num_layers: int = 24
    num_heads: int = 14
    num_kv_heads: int = 2
    intermediate_size: int = 4864
    vocab_size: int = 151936
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    speech_token_size: int = 6561

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def speech_vocab(self) -> int:
        """Speech tokens, then end of speech (`speech_token_size`) and two more stop tokens."""
        return self.speech_token_size + 3


SOS_EOS, TASK_ID = 0, 1  # rows of `llm_embedding`


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised in FP32, then scaled in x's dtype (as Qwen2's); one fused kernel in FP32."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on x [..., head_dim] with `Rotary`'s (cos, sin): Qwen2's
    `x * cos + rotate_half(x) * sin`, where rotating a half is a roll by half the head and the
    sign rides on sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class Rotary(nn.Module):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, head_dim] for `rotate` (sin's first half negated)."""
        freqs = positions.float()[:, :, None] * self.inv_freq[None, None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1).to(dtype)[:, None], torch.cat((-sin, sin), dim=-1).to(dtype)[:, None]


@dataclass
class KVCache:
    """Keys and values per layer, [2, rows, kv_heads, capacity, head_dim] (keys, then values:
    a step writes both with one kernel and reads a batch's rows with one gather), and each
    row's length."""

    layers: list[torch.Tensor]
    lengths: torch.Tensor  # [rows], int64

    @classmethod
    def empty(cls, config: Qwen2Config, rows: int, capacity: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> KVCache:
        shape = (2, rows, config.num_kv_heads, capacity, config.head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)],
                   torch.zeros(rows, dtype=torch.long, device=device))

    @property
    def capacity(self) -> int:
        return int(self.layers[0].shape[3])


class Attention(nn.Module):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.config = config
        d, h, kv = config.head_dim, config.num_heads, config.num_kv_heads
        self.qkv_proj = nn.Linear(config.hidden_size, (h + 2 * kv) * d)
        stack_linears(self, "qkv_proj", (("q_proj", h * d), ("k_proj", kv * d), ("v_proj", kv * d)))
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                rows: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] at `positions` [B, T] of cache rows `rows` [B] (`cache`: one layer's of
        `KVCache`): their keys and values are written into the cache in place, then the queries
        attend over the rows' first `mask.shape[-1]` positions under `mask` (`grouped_bias`).
        cos and sin cover every head (`SpeechLM.rotary_tables`: the value heads' leave them as
        they are), so one rotation serves queries and keys, and keys and values go in together."""
        cfg = self.config
        b, t, _ = x.shape
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = rotate(self.qkv_proj(x).view(b, t, h + 2 * kv, d).transpose(1, 2), cos, sin)
        # cache[:, rows[i], :, positions[i, j]] = new[i, j]: advanced indices around a slice put [B, T] first
        new = qkv[:, h:].view(b, 2, kv, t, d).permute(0, 3, 1, 2, 4)
        cache[:, rows[:, None], :, positions] = new.to(cache.dtype)
        past = cache[:, rows, :, : mask.shape[-1]].to(x.dtype)  # [2, B, kv, span, d]
        # Grouped-query attention as plain attention over the key-value heads, each taking its
        # group of query heads as its queries (with enable_gqa and a mask, CUDA's SDPA falls back
        # to its many-kernel math path).
        # One fused kernel for token steps too: a row's tokens must not depend on what else is in
        # its batch. With this kernel they did not on CUDA (the engine's batched-against-alone
        # test); plain matmuls and a softmax over the batch's span rounded differently with the
        # batch there, and the sampled tokens parted ways.
        q = qkv[:, :h].reshape(b, kv, h // kv * t, d)
        out = F.scaled_dot_product_attention(q, past[0], past[1], attn_mask=mask)
        return self.o_proj(out.reshape(b, h, t, d).transpose(1, 2).reshape(b, t, h * d))


class MLP(nn.Module):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * size, bias=False)
        stack_linears(self, "gate_up_proj", (("gate_proj", size), ("up_proj", size)))
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                rows: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, rows, positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def grouped_bias(allowed: torch.Tensor, config: Qwen2Config, dtype: torch.dtype) -> torch.Tensor:
    """The attention bias [B, 1, G * T, S] (0 or -inf) of `allowed` [B, T, S] for queries grouped
    per key-value head (G query heads each, head-major), made once for every layer."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, -math.inf)
    return bias[:, None].repeat(1, 1, config.num_heads // config.num_kv_heads, 1)


class SpeechLM(nn.Module):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)
        self.llm_embedding = nn.Embedding(2, config.hidden_size)  # sos/eos, task id
        self.speech_embedding = nn.Embedding(config.speech_vocab, config.hidden_size)
        self.llm_decoder = nn.Linear(config.hidden_size, config.speech_vocab)

    def prompt(self, text: torch.Tensor, prompt_speech: torch.Tensor | None = None) -> torch.Tensor:
        """[sos, text, task id, prompt speech tokens] as embeddings [T, D] (one session)."""
        parts = [self.llm_embedding.weight[SOS_EOS:SOS_EOS + 1], self.embed_tokens(text),
                 self.llm_embedding.weight[TASK_ID:TASK_ID + 1]]
        if prompt_speech is not None and prompt_speech.numel():
            parts.append(self.speech_embedding(prompt_speech))
        return torch.cat(parts, dim=0)

    def rotary_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotate`'s cos and sin [B, heads, T, head_dim] for every head of a layer's query, key
        and value projection: the rotary positions for query and key heads, 1 and 0 (the identity,
        exactly) for value heads; made once for every layer."""
        cfg = self.config
        cos, sin = self.rotary(positions, dtype)
        b, _, t, d = cos.shape
        rotated, kept = cfg.num_heads + cfg.num_kv_heads, (b, cfg.num_kv_heads, t, d)
        return (torch.cat([cos.expand(b, rotated, t, d), cos.new_ones(kept)], dim=1),
                torch.cat([sin.expand(b, rotated, t, d), sin.new_zeros(kept)], dim=1))

    def forward(self, x: torch.Tensor, cache: KVCache, rows: torch.Tensor, lengths: torch.Tensor | None = None,
                span: int | None = None) -> torch.Tensor:
        """Embeddings x [B, T, D] appended to cache rows `rows` (each row's new tokens are its
        first `lengths[i]` of T; None: all T) -> speech-vocabulary log-probabilities [B, V] after
        each row's last new token. The rows' cache lengths advance. `span`: a bound on the rows'
        lengths after this call (the positions attention reads; None: the cache's capacity)."""
        b, t, _ = x.shape
        device = x.device
        new = torch.full((b,), t, dtype=torch.long, device=device) if lengths is None else lengths
        start = cache.lengths[rows]
        positions = start[:, None] + torch.arange(t, device=device)[None, :]
        cos, sin = self.rotary_tables(positions, x.dtype)
        slots = torch.arange(cache.capacity if span is None else span, device=device)
        # Each query sees the cache up to its own position: the row's past and its new tokens so far.
        mask = grouped_bias(slots[None, None, :] <= positions[:, :, None], self.config, x.dtype)
        # Padding past a row's new tokens is written (and later overwritten) but never read.
        positions = positions.clamp(max=cache.capacity - 1)
        h = x
        for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
            h = layer(h, cos, sin, layer_cache, rows, positions, mask)
        last = self.norm(h[torch.arange(b, device=device), new - 1])
        cache.lengths[rows] = start + new
        return self.llm_decoder(last).log_softmax(dim=-1)


def lm_state_dict(official: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The official `Qwen2LM` state dict under our names (the Qwen2 head `lm_head` is unused)."""
    ours: dict[str, torch.Tensor] = {}
    for key, value in official.items():
        if key.startswith("llm.model.model."):
            ours[key[len("llm.model.model."):]] = value
        elif not key.startswith("llm.model.lm_head."):
            ours[key] = value
    return ours


def load_lm(config: Qwen2Config, official: Mapping[str, torch.Tensor]) -> SpeechLM:
    model = SpeechLM(config)
    model.load_state_dict(lm_state_dict(official), strict=True)
    return model.eval()


@dataclass(frozen=True)
class SamplingConfig:
    """Repetition-aware sampling (`ras_sampling` in cosyvoice2.yaml): nucleus sampling (top_p,
    at most top_k candidates), unless the pick already filled tau_r of the last win_size tokens;
    then a draw from the whole distribution."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


@dataclass(frozen=True)
class Nucleus:
    """One row's sampling candidates: the whole distribution (the repetition fallback draws
    from it) and the nucleus, most likely first."""

    probs: torch.Tensor  # [V]
    top: torch.Tensor  # [n] the candidates' probabilities, largest first (n <= top_k)
    ids: torch.Tensor  # [n] their token ids


def nuclei(logp: torch.Tensor, config: SamplingConfig) -> list[Nucleus]:
    """Each row's candidates from log-probabilities [R, V], the rows in one pass of a few ops.

    Upstream sorts the whole vocabulary (stably) to take at most top_k candidates; the top_k + 1
    largest give the same candidates in the same order wherever none of them ties with the next
    (then the first top_k are strictly larger than everything else), and a row with such a tie
    is sorted whole, as upstream does. A full sort of each row would cost far more than the LM
    step it follows."""
    probs = logp.softmax(dim=-1)
    ranked, order = probs.topk(min(config.top_k + 1, probs.shape[-1]), dim=-1)
    for i in (ranked[:, 1:] == ranked[:, :-1]).any(dim=1).nonzero().flatten().tolist():
        whole, at = probs[i].sort(descending=True, stable=True)
        ranked[i], order[i] = whole[: ranked.shape[1]], at[: ranked.shape[1]]
    # Candidates while the mass taken before each is under top_p (the last one may cross it).
    before = torch.cat([ranked.new_zeros(ranked.shape[0], 1), torch.cumsum(ranked, dim=-1)[:, :-1]], dim=1)
    counts = (before < config.top_p).sum(dim=1).clamp(1, config.top_k).tolist()
    return [Nucleus(probs[i], ranked[i, :n], order[i, :n]) for i, n in enumerate(counts)]


def _ras(nucleus: Nucleus, decoded: list[int], config: SamplingConfig, generator: torch.Generator | None) -> int:
    pick = int(nucleus.ids[torch.multinomial(nucleus.top, 1, replacement=True, generator=generator)])
    recent = decoded[-config.win_size:]
    if sum(t == pick for t in recent) >= config.win_size * config.tau_r:
        pick = int(torch.multinomial(nucleus.probs, 1, replacement=True, generator=generator))
    return pick


def sample_token(nucleus: Nucleus, decoded: list[int], config: SamplingConfig,
                 generator: torch.Generator | None, redraw: int | None = None, max_trials: int = 100) -> int:
    """One speech token from a row's candidates (`nuclei`), drawing from `generator` (the
    session's own RNG) the numbers the official sampler draws from the global one.
    `redraw`: a token not to end on yet (end of speech before the minimum length): drawn
    again, at most `max_trials` times, as upstream does."""
    for _ in range(max_trials + 1):
        pick = _ras(nucleus, decoded, config, generator)
        if pick != redraw:
            return pick
    raise RuntimeError(f"sampling gave token {redraw} (end of speech) {max_trials + 1} times in a row "
                       "before the minimum length; the LM's scores put nearly all mass on it")


@dataclass(frozen=True)
class LengthLimits:
    """Speech tokens per text token (upstream's `min_token_text_ratio` / `max_token_text_ratio`)."""

    min_ratio: float = 2.0
    max_ratio: float = 20.0


def generate(lm: SpeechLM, text: torch.Tensor, prompt_text: torch.Tensor, prompt_speech: torch.Tensor,
             sampling: SamplingConfig, generator: torch.Generator | None, limits: LengthLimits | None = None,
             ) -> Iterator[int]:
    """One session's speech tokens, as upstream's `Qwen2LM.inference` makes them: the prompt's
    text before the text, end of speech not taken before `min_ratio` tokens per text token,
    at most `max_ratio` per text token; the two other stop tokens are not spoken (the last input
    is fed again). The engine batches these steps across sessions; this loop is the reference."""
    limits = limits or LengthLimits()
    cfg = lm.config
    eos = cfg.speech_token_size
    n_text = int(text.shape[0])
    min_len, max_len = int(n_text * limits.min_ratio), int(n_text * limits.max_ratio)
    prompt = lm.prompt(torch.cat([prompt_text, text]), prompt_speech)
    cache = KVCache.empty(cfg, rows=1, capacity=prompt.shape[0] + max_len, dtype=prompt.dtype, device=prompt.device)
    row = torch.tensor([0], device=prompt.device)
    x = prompt[None]
    out: list[int] = []
    for i in range(max_len):
        logp = lm(x, cache, row)[0]
        token = sample_token(nuclei(logp[None], sampling)[0], out, sampling, generator,
                             redraw=eos if i < min_len else None)
        if token == eos:
            return
        if token > eos:
            continue  # a stop token other than end of speech: not spoken, the same input again
        yield token
        out.append(token)
        x = lm.speech_embedding.weight[token][None, None]
