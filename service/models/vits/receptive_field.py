"""How many latent frames of context a chunk needs so that its trimmed output
equals the same span of a full decode. Computed from the layers, not tuned."""

from __future__ import annotations

import math

from torch import nn

from service.models.vits.flow import ResidualCouplingFlow
from service.models.vits.generator import Generator, ResBlock1, ResBlock2


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
    """Each coupling's WaveNet sees sum of its conv radii; couplings chain."""
    total = 0
    for layer in flow.flows.values():
        for conv in layer.enc.in_layers:  # type: ignore[union-attr]
            assert isinstance(conv, nn.Conv1d)
            total += _conv_radius(conv)
    return total
