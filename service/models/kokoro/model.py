"""Kokoro-82M split into the two stages the engine serves.

* `acoustic(ids, style, speed)`: phoneme ids -> frames per phoneme and the decoder's
  per-frame input (text features `asr` [B, 512, T], F0 and energy `n` [B, 2T]). Needs the
  whole utterance (ALBERT and the LSTMs are bidirectional).
* `decode(asr, f0, n, style, noise)`: that input -> audio [B, T x 600] at 24 kHz.

The style is the voice pack's row for the utterance's phoneme count, [B, 256]: its first half
conditions the decoder, its second half the prosody predictor. Both stages take the whole row.

Parameter names and shapes are the official `kokoro.model.KModel`'s, so its state dict loads
with `load_state_dict(strict=True)`. Our convolutions are plain (no weight-norm
parametrisation): a load folds any `weight_g`/`weight_v` (or parametrisation) pair into
`weight` on the way in (`fold_weight_norm`), so a dict that is already folded loads as well.

Why the decoder is not cut into chunks: every AdaIN normalises over the whole utterance's time
axis, at every rate up to the last generator scale, and each layer's statistics depend on the
layer before over the whole utterance; a chunk equals the full decode only after the full decode.
What batches instead is whole utterances of different lengths, padded: `decode(..., frames=)`
normalises each row over its own frames and gives each row what it would give alone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from service.models.kokoro.albert import Albert
from service.models.kokoro.hparams import KokoroHParams
from service.models.kokoro.istftnet import Decoder, Generator
from service.models.kokoro.prosody import ProsodyPredictor, TextEncoder
from service.models.weight_norm import fold_weight_norm


class AcousticOutput(NamedTuple):
    """One utterance after the acoustic stage (batch of one)."""

    durations: torch.Tensor  # [N] int64 frames per phoneme (each >= 1)
    asr: torch.Tensor  # [1, hidden_dim, T] text features per frame
    f0: torch.Tensor  # [1, 2T] F0 in Hz at twice the frame rate
    n: torch.Tensor  # [1, 2T] energy at twice the frame rate


class KokoroModel(nn.Module):
    def __init__(self, hp: KokoroHParams | None = None) -> None:
        super().__init__()
        hp = hp or KokoroHParams()
        self.hp = hp
        self.bert = Albert(hp.albert)
        self.bert_encoder = nn.Linear(hp.albert.hidden_size, hp.hidden_dim)
        self.predictor = ProsodyPredictor(hp.style_dim, hp.hidden_dim, hp.n_layer, hp.max_dur)
        self.text_encoder = TextEncoder(hp.hidden_dim, hp.text_encoder_kernel_size, hp.n_layer, hp.n_token)
        generator = Generator(
            hp.style_dim, hp.resblock_kernel_sizes, hp.resblock_dilation_sizes, hp.upsample_rates,
            hp.upsample_kernel_sizes, hp.upsample_initial_channel, hp.istft_n_fft, hp.istft_hop, hp.sample_rate,
        )
        self.decoder = Decoder(hp.hidden_dim, hp.style_dim, generator)
        self.register_load_state_dict_pre_hook(_fold_on_load)

    @property
    def samples_per_frame(self) -> int:
        """Audio samples per acoustic frame: 600 for Kokoro-82M (25 ms at 24 kHz)."""
        return self.hp.samples_per_frame

    @property
    def source_harmonics(self) -> int:
        return self.decoder.generator.m_source.harmonics

    def _halves(self, style: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Style row [B, 2 x style_dim] -> (decoder half, prosody half)."""
        if style.dim() == 1:
            style = style.unsqueeze(0)
        d = self.hp.style_dim
        if style.shape[-1] != 2 * d:
            raise ValueError(f"style vector has {style.shape[-1]} values; Kokoro takes {2 * d}")
        return style[:, :d], style[:, d:]

    def acoustic(self, ids: torch.Tensor, style: torch.Tensor, speed: float = 1.0) -> AcousticOutput:
        """Phoneme ids [1, N] (or [N], with the boundary 0s already around them), style [1, 256]
        -> durations and per-frame decoder input. `speed` divides every duration."""
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.shape[0] != 1:
            raise ValueError("acoustic takes one utterance; acoustic_batch takes several")
        if style.dim() == 1:
            style = style.unsqueeze(0)
        lengths = torch.tensor([ids.shape[1]], device=ids.device)
        return self.acoustic_batch(ids, lengths, style, torch.tensor([float(speed)], device=ids.device))[0]

    def acoustic_batch(self, ids: torch.Tensor, lengths: torch.Tensor, style: torch.Tensor,
                       speed: torch.Tensor) -> list[AcousticOutput]:
        """Utterances padded into ids [B, N] with `lengths` [B], styles [B, 256], speeds [B] ->
        each one's acoustic output, equal to its run alone (the LSTMs run packed, the convs and
        norms see each row's own positions)."""
        _, prosody_style = self._halves(style)
        # No row padded (one utterance, or equal lengths): no masks, no packing; the same values.
        padded = lengths if int(lengths.min()) < ids.shape[1] else None
        d = self.predictor.text_encoder(self.bert_encoder(self.bert(ids, padded)), prosody_style, padded)
        # torch.round is half-to-even, as the official model rounds.
        durations = torch.round(self.predictor.durations(d, speed, padded)).clamp(min=1).long()
        rows = [durations[b, : int(n)] for b, n in enumerate(lengths.tolist())]
        frames = torch.stack([r.sum() for r in rows])
        top = int(frames.max())
        # Each row's frame -> its phoneme; padded frames read phoneme 0 and are masked downstream.
        src = torch.zeros(len(rows), top, dtype=torch.long, device=ids.device)
        for b, r in enumerate(rows):
            index = torch.repeat_interleave(torch.arange(r.shape[0], device=ids.device), r)
            src[b, : index.shape[0]] = index
        gather = src.unsqueeze(-1)
        en = torch.gather(d, 1, gather.expand(-1, -1, d.shape[-1]))
        f0, n = self.predictor.curves(en, prosody_style, frames if int(frames.min()) < top else None)
        text = self.text_encoder(ids, padded)
        asr = torch.gather(text, 2, src.unsqueeze(1).expand(-1, text.shape[1], -1))
        out = []
        for b, r in enumerate(rows):
            t = int(r.sum())
            out.append(AcousticOutput(r, asr[b : b + 1, :, :t], f0[b : b + 1, : 2 * t], n[b : b + 1, : 2 * t]))
        return out

    def source_noise(self, batch: int, frames: int, generator: torch.Generator | None = None,
                     device: torch.device | str | None = None) -> torch.Tensor:
        """The sine source's standard-normal noise for `frames` acoustic frames,
        [batch, frames x samples_per_frame, harmonics]. Drawn on the CPU from `generator`, so
        a seed gives the same noise on every device."""
        shape = (batch, frames * self.samples_per_frame, self.source_harmonics)
        return torch.randn(shape, generator=generator).to(device or "cpu")

    def decode(self, asr: torch.Tensor, f0: torch.Tensor, n: torch.Tensor, style: torch.Tensor,
               noise: torch.Tensor | None = None, generator: torch.Generator | None = None,
               frames: torch.Tensor | None = None) -> torch.Tensor:
        """asr [B, 512, T], F0 and N [B, 2T], style [B, 256] -> audio [B, T x 600].

        `noise`: the sine source's noise (`source_noise`'s shape); None draws it from
        `generator`. The output is deterministic given it. `frames` [B]: rows padded to T, each
        with its own frame count (inputs zero past it): each row's audio is its decode alone,
        zero past its end."""
        decoder_style, _ = self._halves(style)
        if noise is None:
            noise = self.source_noise(asr.shape[0], asr.shape[-1], generator, asr.device)
        expected = (asr.shape[0], asr.shape[-1] * self.samples_per_frame, self.source_harmonics)
        if tuple(noise.shape) != expected:
            raise ValueError(f"source noise is {tuple(noise.shape)}; this input needs {expected}")
        return self.decoder(asr, f0, n, decoder_style, noise.to(asr.dtype), frames)

    def forward(self, ids: torch.Tensor, style: torch.Tensor, speed: float = 1.0,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Both stages: (audio [1, T x 600], durations [N])."""
        out = self.acoustic(ids, style, speed)
        return self.decode(out.asr, out.f0, out.n, style, generator=generator), out.durations


def _fold_on_load(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """load_state_dict pre-hook: weight-normed pairs under `prefix` become plain weights."""
    ours = {k[len(prefix):]: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
    for key, value in fold_weight_norm(ours).items():
        state_dict[prefix + key] = value


def load_official(state_dict: Mapping[str, torch.Tensor], hp: KokoroHParams | None = None) -> KokoroModel:
    """A KokoroModel (eval, FP32) from an official `KModel.state_dict()`-style dict."""
    model = KokoroModel(hp)
    model.load_state_dict(dict(state_dict), strict=True)
    return model.eval()
