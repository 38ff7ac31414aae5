"""The VITS network split into its two serving stages.

* acoustic: phoneme ids -> latent frames z [B, C, T] + integer frame durations
  per phoneme (whole utterance: attention needs every phoneme).
* vocode: latent frames -> waveform (convolutional, so it can run in chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from service.models.vits.duration import StochasticDurationPredictor
from service.models.vits.flow import ResidualCouplingFlow
from service.models.vits.generator import Generator
from service.models.vits.hparams import VitsHParams
from service.models.vits.text_encoder import TextEncoder, sequence_mask


@dataclass
class AcousticOutput:
    """Latent frames and their alignment for a batch of utterances."""

    z: torch.Tensor  # [B, inter_channels, T_frames], zero past each frame length
    frame_lengths: torch.Tensor  # [B] int64
    durations: torch.Tensor  # [B, T_phonemes] int64 frames per phoneme id
    g: torch.Tensor | None  # [B, gin, 1] speaker conditioning for the vocoder


class VitsModel(nn.Module):
    def __init__(self, hp: VitsHParams) -> None:
        super().__init__()
        self.hp = hp
        self.enc_p = TextEncoder(
            hp.n_vocab, hp.inter_channels, hp.hidden_channels, hp.filter_channels, hp.n_heads,
            hp.n_layers, hp.kernel_size, hp.window_size, hp.heads_share,
        )
        self.dp = StochasticDurationPredictor(
            hp.hidden_channels, hp.dp_filter_channels, hp.dp_kernel_size, hp.dp_n_flows,
            hp.dp_num_bins, hp.dp_tail_bound, hp.gin_channels,
        )
        self.flow = ResidualCouplingFlow(
            hp.inter_channels, hp.hidden_channels, hp.flow_kernel_size, hp.flow_dilation_rate,
            hp.flow_n_layers, hp.flow_n_flows, hp.gin_channels,
        )
        self.dec = Generator(
            hp.inter_channels, hp.resblock, hp.resblock_kernel_sizes, hp.resblock_dilation_sizes,
            hp.upsample_rates, hp.upsample_initial_channel, hp.upsample_kernel_sizes,
            hp.gin_channels, hp.conv_pre_kernel, hp.conv_post_kernel,
        )
        self.emb_g = nn.Embedding(hp.n_speakers, hp.gin_channels) if hp.gin_channels else None

    def speaker_embedding(self, sid: torch.Tensor | None) -> torch.Tensor | None:
        if self.emb_g is None:
            return None
        if sid is None:
            sid = torch.zeros(1, dtype=torch.long, device=self.emb_g.weight.device)
        return self.emb_g(sid).unsqueeze(-1)

    def uses_speaker(self, stage: int) -> bool:
        """Whether staged-decoder stage `stage` is conditioned on the speaker (the flow's
        couplings and the generator's first stage are)."""
        return self.emb_g is not None and stage <= self.flow.num_stages

    def decoder_stage(
        self, index: int, x: torch.Tensor, g: torch.Tensor | None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Staged-decoder stage `index`: the flow's couplings in inference order, then the
        generator's stages. Running them in order is `flow_reverse` then `vocode`. `mask`
        [B, 1, output length]: 1 inside the utterance (see Generator.stage)."""
        n_flow = self.flow.num_stages
        if index < n_flow:
            y = self.flow.stage(index, x, g, mask)
            return y if mask is None else y * mask
        return self.dec.stage(index - n_flow, x, g, mask)

    def encode(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        dp_noise: torch.Tensor,
        sid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Phoneme ids -> prior mean/log-scale per phoneme, log-durations, mask.

        dp_noise [B, 2, T] is the duration predictor's noise, already scaled."""
        x, m_p, logs_p, x_mask = self.enc_p(ids, lengths)
        g = self.speaker_embedding(sid)
        logw = self.dp(x, x_mask, dp_noise.to(x.dtype), g=g)
        return m_p, logs_p, logw * x_mask, x_mask

    def flow_reverse(
        self, z_p: torch.Tensor, y_mask: torch.Tensor, sid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Prior sample [B, C, T] -> latent frames for the vocoder."""
        g = self.speaker_embedding(sid)
        return self.flow(z_p, y_mask, g=g) * y_mask

    def acoustic(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        *,
        sid: torch.Tensor | None = None,
        noise_scale: torch.Tensor | float = 0.667,
        length_scale: torch.Tensor | float = 1.0,
        noise_w: torch.Tensor | float = 0.8,
        generators: list[torch.Generator] | None = None,
    ) -> AcousticOutput:
        """Encoder, durations and flow in one call. Scales are floats or [B]
        tensors; each item draws its noise from its own generator, so batching
        never changes a seeded result."""
        b = ids.shape[0]
        dtype, device = torch.float32, ids.device
        ns = _per_item(noise_scale, b, dtype, device)
        ls = _per_item(length_scale, b, dtype, device)
        nw = _per_item(noise_w, b, dtype, device)
        dp_noise = _noise(generators, [(2, int(n)) for n in lengths], ids.shape[1], dtype, device)
        m_p, logs_p, logw, x_mask = self.encode(ids, lengths, dp_noise * nw, sid)
        durations, frame_lengths = durations_from_logw(logw, x_mask, ls)
        t_y = int(frame_lengths.max())
        m_y, logs_y, y_mask = expand_to_frames(m_p, logs_p, durations, frame_lengths)
        prior_noise = _noise(
            generators, [(m_p.shape[1], int(n)) for n in frame_lengths], t_y, dtype, device
        )
        z_p = m_y + prior_noise.to(m_y.dtype) * torch.exp(logs_y) * ns.to(m_y.dtype)
        z = self.flow_reverse(z_p, y_mask, sid)
        return AcousticOutput(
            z=z, frame_lengths=frame_lengths, durations=durations, g=self.speaker_embedding(sid)
        )

    def vocode(self, z: torch.Tensor, sid: torch.Tensor | None = None) -> torch.Tensor:
        """Latent frames [B, C, T] -> audio [B, T * hop]."""
        return self.dec(z, g=self.speaker_embedding(sid)).squeeze(1)


def _per_item(
    value: torch.Tensor | float, b: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=dtype, device=device).reshape(-1)
    if t.numel() == 1:
        t = t.expand(b)
    return t.reshape(b, 1, 1)


def _noise(
    generators: list[torch.Generator] | None,
    shapes: list[tuple[int, int]],
    max_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Standard normal noise, one draw per batch item from its own generator (CPU
    generators keep results identical across devices), zero-padded to max_len."""
    out = torch.zeros(len(shapes), shapes[0][0], max_len, dtype=dtype, device=device)
    for i, (channels, length) in enumerate(shapes):
        gen = generators[i] if generators is not None else None
        draw = torch.randn(channels, length, generator=gen, dtype=torch.float32)
        out[i, :, :length] = draw.to(device=device, dtype=dtype)
    return out


def durations_from_logw(
    logw: torch.Tensor, x_mask: torch.Tensor, length_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-durations [B, 1, T] -> integer frames per phoneme [B, T] and total
    frames [B] (ceil, at least one frame per utterance, as VITS does)."""
    w_ceil = torch.ceil(torch.exp(logw.float()) * x_mask.float() * length_scale)
    frame_lengths = torch.clamp_min(torch.sum(w_ceil, dim=[1, 2]), 1).long()
    return w_ceil.squeeze(1).long(), frame_lengths


def expand_to_frames(
    m_p: torch.Tensor, logs_p: torch.Tensor, durations: torch.Tensor, frame_lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Repeat each phoneme's prior statistics for its frames (hard monotonic path)."""
    b = m_p.shape[0]
    t_y = int(frame_lengths.max())
    device = m_p.device
    y_mask = sequence_mask(frame_lengths, t_y).unsqueeze(1).to(m_p.dtype)
    ends = torch.cumsum(durations, dim=1)
    frames = torch.arange(t_y, device=device).unsqueeze(0).expand(b, -1).contiguous()
    src = torch.searchsorted(ends, frames, right=True).clamp(max=m_p.shape[2] - 1)
    index = src.unsqueeze(1).expand(-1, m_p.shape[1], -1)
    return m_p.gather(2, index) * y_mask, logs_p.gather(2, index) * y_mask, y_mask
