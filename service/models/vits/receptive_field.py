"""How many latent frames of context a chunk needs so that its trimmed output
equals the same span of a full decode. Computed from the layers, not tuned."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch import nn

from service.models.vits.flow import MeanOnlyCoupling, ResidualCouplingFlow
from service.models.vits.generator import Generator, ResBlock1, ResBlock2

if TYPE_CHECKING:
    from service.models.vits.model import VitsModel


def _conv_radius(conv: nn.Conv1d) -> int:
    """Samples on each side a 'same'-padded conv looks at."""
    k, d = int(conv.kernel_size[0]), int(conv.dilation[0])
    return (d * (k - 1) + 1) // 2


def generator_halo_frames(gen: Generator) -> int:
    """Walk the generator from its output back to its input, growing the halo
    (in samples of the current layer's rate) through every conv."""
    halo = _conv_radius(gen.conv_post)
    k = gen.num_kernels
    for i in reversed(range(len(gen.ups))):
        blocks = gen.resblocks[i * k : (i + 1) * k]
        widest = 0
        for blk in blocks:
            assert isinstance(blk, (ResBlock1, ResBlock2))
            widest = max(widest, sum(_conv_radius(c) for c in blk.layers()))
        halo += widest
        up = gen.ups[i]
        assert isinstance(up, nn.ConvTranspose1d)
        kernel, stride = int(up.kernel_size[0]), int(up.stride[0])
        pad = int(up.padding[0])
        # Output n reads inputs i with i*stride in [n + pad - kernel + 1, n + pad].
        halo = math.ceil((halo + max(pad, kernel - 1 - pad)) / stride)
    return halo + _conv_radius(gen.conv_pre)


def flow_halo_frames(flow: ResidualCouplingFlow) -> int:
    """Each coupling's WaveNet sees the sum of its conv radii; couplings chain."""
    return sum(context for _, context, _ in flow_stage_table(flow))


def flow_stage_table(flow: ResidualCouplingFlow) -> list[tuple[int, int, int]]:
    """(1, input context, output channels) per flow stage (one coupling each)."""
    out = []
    for index in range(flow.num_stages):
        coupling = flow.coupling(index)
        if not isinstance(coupling, MeanOnlyCoupling):
            raise TypeError("stage tables are read from the trained couplings, not folded ones")
        convs = [conv for conv in coupling.enc.in_layers if isinstance(conv, nn.Conv1d)]
        context = sum(_conv_radius(conv) for conv in convs)
        out.append((1, context, 2 * coupling.half_channels))
    return out


def generator_stage_table(gen: Generator) -> list[tuple[int, int, int]]:
    """(upsampling factor, input context, output channels) per generator stage."""
    channels = [int(gen.conv_pre.out_channels)]
    for up in gen.ups:
        assert isinstance(up, nn.ConvTranspose1d)
        channels.append(int(up.out_channels))
    channels[-1] = 1  # the last stage ends in conv_post: one audio channel
    return [(f, c, ch) for (f, c), ch in zip(generator_stage_contexts(gen), channels, strict=True)]


def generator_stage_contexts(gen: Generator) -> list[tuple[int, int]]:
    """Per generator stage: (upsampling factor, input samples of context needed on each
    side) so that a stage run on an input window gives exact outputs away from the
    window's clipped edges."""
    out = [(1, _conv_radius(gen.conv_pre))]
    k = gen.num_kernels
    last = len(gen.ups) - 1
    for i, up in enumerate(gen.ups):
        assert isinstance(up, nn.ConvTranspose1d)
        widest = 0
        for blk in gen.resblocks[i * k : (i + 1) * k]:
            assert isinstance(blk, (ResBlock1, ResBlock2))
            widest = max(widest, sum(_conv_radius(c) for c in blk.layers()))
        if i == last:
            widest += _conv_radius(gen.conv_post)
        kernel, stride, pad = int(up.kernel_size[0]), int(up.stride[0]), int(up.padding[0])
        out.append((stride, math.ceil((widest + max(pad, kernel - 1 - pad)) / stride) + 1))
    return out


def decoder_stage_table(model: VitsModel) -> list[tuple[int, int, int]]:
    """The staged decoder's stages in run order: flow couplings, then generator stages."""
    return flow_stage_table(model.flow) + generator_stage_table(model.dec)
