"""HiFi-GAN generator: latent frames -> waveform in [-1, 1]."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

LRELU_SLOPE = 0.1


def same_padding(kernel_size: int, dilation: int) -> int:
    return (kernel_size * dilation - dilation) // 2


def _masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x if mask is None else x * mask


class ResBlock1(nn.Module):
    """Pairs of (dilated conv, plain conv) with residuals (HiFi-GAN V1)."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=same_padding(kernel_size, d))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, padding=same_padding(kernel_size, 1))
            for _ in dilations
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask` (1 inside the utterance, 0 outside) zeroes every conv's input outside the
        utterance, so a window reaching past its edges equals the unwindowed decode."""
        for c1, c2 in zip(self.convs1, self.convs2, strict=True):
            xt = c2(_masked(F.leaky_relu(c1(F.leaky_relu(x, LRELU_SLOPE)), LRELU_SLOPE), mask))
            x = _masked(x + xt, mask)
        return x

    def layers(self) -> list[nn.Conv1d]:
        out: list[nn.Conv1d] = []
        for c1, c2 in zip(self.convs1, self.convs2, strict=True):
            out += [c1, c2]  # type: ignore[list-item]
        return out


class ResBlock2(nn.Module):
    """Dilated convs with residuals (HiFi-GAN V3, Piper's medium/low voices)."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=same_padding(kernel_size, d))
            for d in dilations
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for conv in self.convs:
            x = _masked(x + conv(F.leaky_relu(x, LRELU_SLOPE)), mask)
        return x

    def layers(self) -> list[nn.Conv1d]:
        return list(self.convs)  # type: ignore[arg-type]


class Generator(nn.Module):
    def __init__(
        self,
        in_channels: int,
        resblock: str,
        resblock_kernel_sizes: tuple[int, ...],
        resblock_dilation_sizes: tuple[tuple[int, ...], ...],
        upsample_rates: tuple[int, ...],
        upsample_initial_channel: int,
        upsample_kernel_sizes: tuple[int, ...],
        gin_channels: int,
        conv_pre_kernel: int = 7,
        conv_post_kernel: int = 7,
    ) -> None:
        super().__init__()
        self.num_kernels = len(resblock_kernel_sizes)
        self.upsample_rates = tuple(upsample_rates)
        self.conv_pre = nn.Conv1d(
            in_channels, upsample_initial_channel, conv_pre_kernel,
            padding=(conv_pre_kernel - 1) // 2,
        )
        block = ResBlock1 if resblock == "1" else ResBlock2
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        ch = upsample_initial_channel
        for rate, kernel in zip(upsample_rates, upsample_kernel_sizes, strict=True):
            self.ups.append(
                nn.ConvTranspose1d(ch, ch // 2, kernel, rate, padding=(kernel - rate) // 2)
            )
            ch //= 2
            for k, d in zip(resblock_kernel_sizes, resblock_dilation_sizes, strict=True):
                self.resblocks.append(block(ch, k, tuple(d)))
        self.conv_post = nn.Conv1d(
            ch, 1, conv_post_kernel, padding=(conv_post_kernel - 1) // 2, bias=False
        )
        self.cond = nn.Conv1d(gin_channels, upsample_initial_channel, 1) if gin_channels else None

    @property
    def num_stages(self) -> int:
        """conv_pre, then one stage per upsampling layer (the last one ends in conv_post)."""
        return len(self.ups) + 1

    def stage(
        self, index: int, x: torch.Tensor, g: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One stage of the generator. Running the stages in order is `forward`; running
        them separately lets a streaming decoder keep each stage's output instead of
        recomputing every layer's context for every chunk. `mask` [B, 1, output length]
        marks the output positions inside the utterance: with it, a fixed-size window
        that reaches past the utterance's edges still equals the unwindowed decode (every
        conv sees zeros outside, as its zero padding gives the full decode)."""
        if index == 0:
            x = self.conv_pre(x)
            if g is not None and self.cond is not None:
                x = x + self.cond(g)
            return _masked(x, mask)
        i = index - 1
        x = _masked(self.ups[i](F.leaky_relu(x, LRELU_SLOPE)), mask)
        blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
        acc = blocks[0](x, mask)
        for blk in blocks[1:]:
            acc = acc + blk(x, mask)
        x = acc / self.num_kernels
        if index == self.num_stages - 1:
            x = _masked(torch.tanh(self.conv_post(F.leaky_relu(x))), mask)
        return x

    def stage_lengths(self, frames: int) -> list[int]:
        """Output length of every stage for `frames` latent frames (a transposed conv's
        length formula; kernel = stride + 2 x padding gives frames x stride)."""
        out = [frames]
        for up in self.ups:
            assert isinstance(up, nn.ConvTranspose1d | PolyphaseUpsample)
            k, s, p = _upsample_shape(up)
            out.append((out[-1] - 1) * s - 2 * p + k)
        return out

    def forward(self, x: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        for index in range(self.num_stages):
            x = self.stage(index, x, g)
        return x


class PolyphaseUpsample(nn.Module):
    """A ConvTranspose1d (kernel = 2 x stride) computed as plain convolutions, one
    output channel block per output phase, then interleaved. Same function; on ONNX
    Runtime CPU it avoids the transposed conv's column scatter (about 2% less
    synthesis time end to end). Inference only.

    Output sample n = S*m + r (S = stride x f phases, f chosen so S >= 8: ORT's
    transpose of an 8-wide phase axis is fast) reads two neighbouring inputs; phases
    whose two inputs start at the same offset share one conv. The interleaved
    result starts `padding` samples early and is cut to the transposed conv's
    length."""

    MIN_PHASES = 8

    def __init__(self, up: nn.ConvTranspose1d, groups: list[tuple[int, list[int]]], folds: int) -> None:
        super().__init__()
        weight = up.weight.detach()  # [in, out, kernel]
        in_ch, out_ch, kernel = weight.shape
        self.stride, self.padding = int(up.stride[0]), int(up.padding[0])
        self.folds, self.out_channels = folds, out_ch
        bias = up.bias.detach() if up.bias is not None else torch.zeros(out_ch)
        self.pads: list[tuple[int, int]] = []
        self.convs = nn.ModuleList()
        for offset, phases in groups:
            conv = nn.Conv1d(in_ch, len(phases) * out_ch, 2, stride=folds).requires_grad_(False)
            w = torch.empty(len(phases), out_ch, in_ch, 2)
            for j, phase in enumerate(phases):
                for tap in range(2):
                    k = phase - self.stride * (offset + tap)
                    assert 0 <= k < kernel, "polyphase tap outside the kernel"
                    w[j, :, :, tap] = weight[:, :, k].T
            conv.weight.copy_(w.reshape(-1, in_ch, 2))
            assert conv.bias is not None
            conv.bias.copy_(bias.repeat(len(phases)))
            self.convs.append(conv)
            self.pads.append((-offset, 2 + offset))

    @classmethod
    def from_transposed(cls, up: nn.ConvTranspose1d) -> PolyphaseUpsample | None:
        """The polyphase form of `up`, or None where its shape has none here."""
        s, p, kernel = int(up.stride[0]), int(up.padding[0]), int(up.kernel_size[0])
        if kernel != 2 * s or not 0 <= p <= s or up.dilation[0] != 1 or up.groups != 1 or up.output_padding[0]:
            return None
        for folds in range(max(1, -(-cls.MIN_PHASES // s)), 0, -1):
            phases = s * folds
            by_offset: dict[int, list[int]] = {}
            for r in range(phases):
                first_input = r // s - (1 if r % s < s - p else 0)
                by_offset.setdefault(first_input - folds * ((r + p) // phases), []).append((r + p) % phases)
            groups = sorted(((o, sorted(rs)) for o, rs in by_offset.items()), key=lambda g: g[1][0])
            flat = [r for _, rs in groups for r in rs]
            if flat == list(range(phases)) and all(-2 <= o <= 0 for o, _ in groups):
                return cls(up, groups, folds)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        parts = [conv(F.pad(x, pad)) for conv, pad in zip(self.convs, self.pads, strict=True)]
        y = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
        batch, _, steps = y.shape
        phases = self.stride * self.folds
        y = y.reshape(batch, phases, self.out_channels, steps).permute(0, 2, 3, 1)
        y = y.reshape(batch, self.out_channels, steps * phases)
        out = (length + 1) * self.stride - 2 * self.padding  # the transposed conv's length
        return y[:, :, self.padding : self.padding + out]


def _upsample_shape(up: nn.Module) -> tuple[int, int, int]:
    """(kernel, stride, padding) of a transposed conv or its polyphase form."""
    if isinstance(up, PolyphaseUpsample):
        return 2 * up.stride, up.stride, up.padding
    assert isinstance(up, nn.ConvTranspose1d)
    return int(up.kernel_size[0]), int(up.stride[0]), int(up.padding[0])


def polyphase_upsamplers(gen: Generator) -> None:
    """Replace each of `gen`'s transposed convs that has a polyphase form (in place)."""
    for i, up in enumerate(gen.ups):
        assert isinstance(up, nn.ConvTranspose1d)
        poly = PolyphaseUpsample.from_transposed(up)
        if poly is not None:
            gen.ups[i] = poly
