"""CosyVoice2's flow-matching estimator: a one-level 1-D U-Net of causal conv ResNet blocks and
transformer blocks, conditioned on the time step, that predicts the velocity of the mel at time t
from the noisy mel, the encoder's output (mu), the speaker embedding and the prompt mel.

Module names follow the official `CausalConditionalDecoder` (built on Matcha-TTS's blocks and
diffusers' attention), so `flow.pt`'s `decoder.estimator.*` entries load as they are.

Attention masks stay boolean (True: may attend) all the way into the attention kernel. Upstream
turns them into an additive bias of -1e10, which FP16 cannot hold (-inf; a fully masked row is
then NaN); in FP32 both give exactly zero weight to masked keys, so FP32 results are unchanged."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from service.models.stacked import stack_linears


@dataclass(frozen=True)
class EstimatorConfig:
    """`flow.decoder.estimator` in cosyvoice2.yaml (CosyVoice2-0.5B's values as defaults)."""

    in_channels: int = 320  # noisy mel, mu, speaker, prompt mel: 4 x 80
    out_channels: int = 80
    channels: tuple[int, ...] = (256,)
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    static_chunk_size: int = 50  # frames: 25 tokens x token_mel_ratio 2


class CausalConv1d(nn.Conv1d):
    """A stride-1 convolution that sees only the past: zeros padded on the left."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class _ChannelsLast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class _Resample(nn.Module):
    """A strided (transposed) convolution under the name upstream gives it (`.conv`)."""

    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(x)
        return out


class CausalBlock(nn.Module):
    """Causal conv, LayerNorm over channels, Mish, under the frame mask."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.Sequential(CausalConv1d(dim, dim_out, 3), _ChannelsLast(), nn.LayerNorm(dim_out),
                                   _ChannelsLast(), nn.Mish())

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.block(x * mask) * mask


class CausalResnetBlock(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, dim_out))
        self.block1 = CausalBlock(dim, dim_out)
        self.block2 = CausalBlock(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        h = self.block1(x, mask) + self.mlp(time).unsqueeze(-1)
        return self.block2(h, mask) + self.res_conv(x * mask)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_qkv = nn.Linear(dim, 3 * inner, bias=False)
        stack_linears(self, "to_qkv", (("to_q", inner), ("to_k", inner), ("to_v", inner)))
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, D]; mask [B, 1, T, T], boolean or added to the scores (0 or -inf)."""
        b, t, _ = x.shape
        q, k, v = self.to_qkv(x).view(b, t, 3, self.heads, self.head_dim).transpose(1, 3).unbind(2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class _GeluProj(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class _FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([_GeluProj(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class _TimeMLP(nn.Module):
    def __init__(self, dim: int, time_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(dim, time_dim)
        self.linear_2 = nn.Linear(time_dim, time_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm self-attention and GELU feed-forward (x4), each residual."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = SelfAttention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = _FeedForward(dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), mask)
        return x + self.ff(self.norm3(x))


def attention_mask(frames: torch.Tensor, chunk: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T, T] from the frame mask [B, 1, T]: valid keys only, and with `chunk` > 0 only keys
    up to the end of the query's own chunk (streaming); `rows` [B] (bool), where given, says
    which rows stream, the others attending to every valid key. A query row left with no key
    attends to every key, as upstream does (such rows are padding, masked later)."""
    valid = frames.bool()
    t = valid.shape[-1]
    if chunk > 0:
        pos = torch.arange(t, device=valid.device)
        causal = (pos[None, :] < ((pos // chunk + 1) * chunk)[:, None])[None]
        if rows is not None:
            causal = causal | ~rows[:, None, None]
        mask = valid & causal
    else:
        mask = valid.expand(-1, t, -1)
    empty = ~mask.any(dim=-1, keepdim=True)
    return mask | empty


def timestep_embedding(t: torch.Tensor, dim: int, scale: float = 1000.0) -> torch.Tensor:
    """Sinusoidal embedding of t in [0, 1] (Matcha-TTS's, sin then cos)."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    emb = scale * t.reshape(-1).unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat((emb.sin(), emb.cos()), dim=-1)


class Estimator(nn.Module):
    def __init__(self, config: EstimatorConfig) -> None:
        super().__init__()
        self.config = cfg = config
        channels = cfg.channels
        time_dim = channels[0] * 4
        self.time_mlp = _TimeMLP(cfg.in_channels, time_dim)

        def blocks(dim: int) -> nn.ModuleList:
            return nn.ModuleList(TransformerBlock(dim, cfg.num_heads, cfg.attention_head_dim)
                                 for _ in range(cfg.n_blocks))

        self.down_blocks = nn.ModuleList()
        out = cfg.in_channels
        for i, ch in enumerate(channels):
            last = i == len(channels) - 1
            down: nn.Module = CausalConv1d(ch, ch, 3) if last else _Resample(nn.Conv1d(ch, ch, 3, 2, 1))
            self.down_blocks.append(nn.ModuleList([CausalResnetBlock(out, ch, time_dim), blocks(ch), down]))
            out = ch
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([CausalResnetBlock(channels[-1], channels[-1], time_dim), blocks(channels[-1])])
            for _ in range(cfg.num_mid_blocks))
        ups = (*channels[::-1], channels[0])
        self.up_blocks = nn.ModuleList()
        for i in range(len(ups) - 1):
            last = i == len(ups) - 2
            ch = ups[i + 1]
            up: nn.Module = CausalConv1d(ch, ch, 3) if last else _Resample(nn.ConvTranspose1d(ch, ch, 4, 2, 1))
            self.up_blocks.append(nn.ModuleList([CausalResnetBlock(2 * ups[i], ch, time_dim), blocks(ch), up]))
        self.final_block = CausalBlock(ups[-1], ups[-1])
        self.final_proj = nn.Conv1d(ups[-1], cfg.out_channels, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor, cond: torch.Tensor, streaming: bool | torch.Tensor = False) -> torch.Tensor:
        """Velocity [B, 80, T] of the noisy mel x [B, 80, T] at times t [B], under the frame
        mask [B, 1, T]; mu and cond [B, 80, T], spks [B, 80]. `streaming`: every row's mode, or
        each row's ([B] bool), so streaming and full-context rows share one pass."""
        rows = streaming if isinstance(streaming, torch.Tensor) else None
        chunk = self.config.static_chunk_size if rows is not None or streaming else 0
        time = timestep_embedding(t, self.config.in_channels).to(x.dtype)  # from t as given (FP32 in an FP16 pass)
        time = self.time_mlp(time)
        x = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, x.shape[-1]), cond], dim=1)

        # Each resolution's frame mask and attention bias, made once per pass (the bias as the
        # scores' additive term: what SDPA makes of a boolean mask). Indexed by depth, not by
        # length, so a compiled pass does not specialise on the number of frames.
        masks = [mask]
        for _ in self.down_blocks[1:]:
            masks.append(masks[-1][:, :, ::2])
        biases: dict[int, torch.Tensor] = {}

        def level(stage: nn.Module, h: torch.Tensor, depth: int) -> torch.Tensor:
            """A stage's ResNet block, then its transformer blocks (a stage is [resnet, blocks, ...])."""
            assert isinstance(stage, nn.ModuleList)
            frames = masks[depth]
            h = stage[0](h, frames, time).transpose(1, 2)
            attn = biases.get(depth)
            if attn is None:
                allowed = attention_mask(frames, chunk, rows)[:, None]
                attn = torch.zeros(allowed.shape, dtype=h.dtype, device=h.device).masked_fill(~allowed, -math.inf)
                biases[depth] = attn
            blocks = stage[1]
            assert isinstance(blocks, nn.ModuleList)
            for block in blocks:
                h = block(h, attn)
            return h.transpose(1, 2)

        skips = []
        for depth, stage in enumerate(self.down_blocks):
            x = level(stage, x, depth)
            skips.append(x)
            x = stage[2](x * masks[depth])  # type: ignore[index]
        depth = len(masks) - 1
        for stage in self.mid_blocks:
            x = level(stage, x, depth)
        for stage in self.up_blocks:
            skip = skips.pop()
            x = torch.cat([x[:, :, :skip.shape[-1]], skip], dim=1)
            x = stage[2](level(stage, x, depth) * masks[depth])  # type: ignore[index]
            depth -= 1
        x = self.final_block(x, mask)
        return self.final_proj(x * mask) * mask
