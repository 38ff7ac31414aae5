"""Kokoro-82M hyper-parameters, read from the official `config.json` keys."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AlbertHParams:
    """The PL-BERT text model (ALBERT: one transformer layer shared by every depth)."""

    vocab_size: int = 178
    embedding_size: int = 128
    hidden_size: int = 768
    num_attention_heads: int = 12
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12


@dataclass(frozen=True)
class KokoroHParams:
    n_token: int = 178
    hidden_dim: int = 512
    style_dim: int = 128  # each half of the 256-wide voice-pack row
    n_layer: int = 3
    max_dur: int = 50
    text_encoder_kernel_size: int = 5
    sample_rate: int = 24_000
    upsample_rates: tuple[int, ...] = (10, 6)
    upsample_kernel_sizes: tuple[int, ...] = (20, 12)
    upsample_initial_channel: int = 512
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    istft_n_fft: int = 20
    istft_hop: int = 5
    albert: AlbertHParams = field(default_factory=AlbertHParams)

    @property
    def samples_per_frame(self) -> int:
        """Audio samples per acoustic frame (one `asr` column): the decoder doubles the frame
        rate, the generator upsamples by prod(upsample_rates), the inverse STFT by its hop."""
        scale = 2 * self.istft_hop
        for rate in self.upsample_rates:
            scale *= rate
        return scale

    @property
    def source_upsample(self) -> int:
        """Audio samples per F0 value (F0 runs at twice the frame rate)."""
        return self.samples_per_frame // 2

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> KokoroHParams:
        """From the official `config.json` (its `vocab` and unused keys are ignored)."""
        ist = config["istftnet"]
        bert = config["plbert"]
        return cls(
            n_token=int(config["n_token"]),
            hidden_dim=int(config["hidden_dim"]),
            style_dim=int(config["style_dim"]),
            n_layer=int(config["n_layer"]),
            max_dur=int(config["max_dur"]),
            text_encoder_kernel_size=int(config["text_encoder_kernel_size"]),
            upsample_rates=tuple(int(r) for r in ist["upsample_rates"]),
            upsample_kernel_sizes=tuple(int(k) for k in ist["upsample_kernel_sizes"]),
            upsample_initial_channel=int(ist["upsample_initial_channel"]),
            resblock_kernel_sizes=tuple(int(k) for k in ist["resblock_kernel_sizes"]),
            resblock_dilation_sizes=tuple(tuple(int(d) for d in ds) for ds in ist["resblock_dilation_sizes"]),
            istft_n_fft=int(ist["gen_istft_n_fft"]),
            istft_hop=int(ist["gen_istft_hop_size"]),
            albert=AlbertHParams(
                vocab_size=int(config["n_token"]),
                embedding_size=int(bert.get("embedding_size", 128)),
                hidden_size=int(bert["hidden_size"]),
                num_attention_heads=int(bert["num_attention_heads"]),
                intermediate_size=int(bert["intermediate_size"]),
                num_hidden_layers=int(bert["num_hidden_layers"]),
                max_position_embeddings=int(bert["max_position_embeddings"]),
            ),
        )
