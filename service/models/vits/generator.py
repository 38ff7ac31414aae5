"""HiFi-GAN generator: latent frames -> waveform in [-1, 1]."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

LRELU_SLOPE = 0.1


def same_padding(kernel_size: int, dilation: int) -> int:
    return (kernel_size * dilation - dilation) // 2


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2 in zip(self.convs1, self.convs2, strict=True):
            xt = c2(F.leaky_relu(c1(F.leaky_relu(x, LRELU_SLOPE)), LRELU_SLOPE))
            x = x + xt
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = x + conv(F.leaky_relu(x, LRELU_SLOPE))
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

    def stage(self, index: int, x: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        """One stage of the generator. Running the stages in order is `forward`; running
        them separately lets a streaming decoder keep each stage's output instead of
        recomputing every layer's context for every chunk."""
        if index == 0:
            x = self.conv_pre(x)
            if g is not None and self.cond is not None:
                x = x + self.cond(g)
            return x
        i = index - 1
        x = self.ups[i](F.leaky_relu(x, LRELU_SLOPE))
        blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
        acc = blocks[0](x)
        for blk in blocks[1:]:
            acc = acc + blk(x)
        x = acc / self.num_kernels
        if index == self.num_stages - 1:
            x = torch.tanh(self.conv_post(F.leaky_relu(x)))
        return x

    def forward(self, x: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        for index in range(self.num_stages):
            x = self.stage(index, x, g)
        return x
