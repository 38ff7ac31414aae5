"""VITS hyper-parameters, read off a Piper ONNX graph so any Piper voice loads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class VitsHParams:
    """Shape of one VITS network. Defaults are Piper's `medium` quality."""

    n_vocab: int = 256
    hidden_channels: int = 192
    inter_channels: int = 192
    filter_channels: int = 768
    n_heads: int = 2
    n_layers: int = 6
    kernel_size: int = 3
    window_size: int = 4
    heads_share: bool = True
    # stochastic duration predictor
    dp_filter_channels: int = 192
    dp_kernel_size: int = 3
    dp_n_flows: int = 4
    dp_num_bins: int = 10
    dp_tail_bound: float = 5.0
    # flow
    flow_n_flows: int = 4
    flow_kernel_size: int = 5
    flow_dilation_rate: int = 1
    flow_n_layers: int = 4
    # generator (HiFi-GAN)
    resblock: str = "2"
    resblock_kernel_sizes: tuple[int, ...] = (3, 5, 7)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 2), (2, 6), (3, 12))
    upsample_rates: tuple[int, ...] = (8, 8, 4)
    upsample_initial_channel: int = 256
    upsample_kernel_sizes: tuple[int, ...] = (16, 16, 8)
    conv_pre_kernel: int = 7
    conv_post_kernel: int = 7
    # speakers
    n_speakers: int = 1
    gin_channels: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def hop_length(self) -> int:
        """Audio samples per latent frame (product of the upsample rates)."""
        hop = 1
        for rate in self.upsample_rates:
            hop *= rate
        return hop
