"""Kokoro's decoder: per-frame features + F0 + energy -> 24 kHz audio (iSTFTNet).

The decoder mixes the frame features with F0 and energy in AdaIN residual blocks (2x frame
rate), then the generator upsamples to the STFT frame rate, adding at each scale an
excitation made from a harmonic sine source driven by F0, and predicts a magnitude and phase
spectrum that an inverse STFT turns into samples.

Randomness: the sine source adds Gaussian noise at audio rate. It is an input here
(`source_noise`, standard normal [B, samples, harmonics]) so that runs can be made equal and a
streaming decoder can draw it per sample position."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from service.models.kokoro.layers import AdaIN1d, AdainResBlk1d, frame_mask, masked, snake
from service.models.spectral import istft


class SineSource(nn.Module):
    """Harmonic-plus-noise excitation (NSF): F0 at audio rate -> one excitation channel.

    Harmonics 1..`harmonics` of F0 are summed into a phase that is accumulated at the F0
    rate (one value per `upsample` samples) and interpolated linearly to audio rate, which
    is cheap and keeps the phase smooth. Unvoiced samples (F0 <= threshold) carry noise only.
    `l_linear` mixes the harmonics; the official name is kept."""

    def __init__(self, sample_rate: int, upsample: int, harmonics: int = 9, amplitude: float = 0.1,
                 voiced_noise: float = 0.003, voiced_threshold: float = 10.0) -> None:
        super().__init__()
        self.sample_rate = sample_rate
        self.upsample = upsample
        self.harmonics = harmonics
        self.amplitude = amplitude
        self.voiced_noise = voiced_noise
        self.voiced_threshold = voiced_threshold
        self.l_linear = nn.Linear(harmonics, 1)

    def phase(self, f0: torch.Tensor) -> torch.Tensor:
        """F0 [B, L] at its own rate -> phase in radians [B, L * upsample, harmonics].

        Per F0 step the phase advances by the fractional cycles of each harmonic over one
        audio sample, times `upsample` (the interpolation's scale): the official model's
        downsample-then-cumsum of its audio-rate increments reduces to exactly this, because
        its 1/upsample linear interpolation reads two equal samples of a held F0 value."""
        k = torch.arange(1, self.harmonics + 1, device=f0.device, dtype=f0.dtype)
        cycles = (f0.unsqueeze(-1) * k / self.sample_rate) % 1
        step_phase = torch.cumsum(cycles, dim=1) * 2 * math.pi
        return F.interpolate(step_phase.transpose(1, 2) * self.upsample, scale_factor=self.upsample,
                             mode="linear").transpose(1, 2)

    def forward(self, f0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """F0 [B, L] (its own rate), noise [B, L * upsample, harmonics] standard normal ->
        excitation [B, L * upsample]."""
        sines = torch.sin(self.phase(f0)) * self.amplitude
        voiced = (f0 > self.voiced_threshold).to(f0.dtype).repeat_interleave(self.upsample, dim=1).unsqueeze(-1)
        noise_amp = voiced * self.voiced_noise + (1 - voiced) * self.amplitude / 3
        excitation = sines * voiced + noise_amp * noise
        return torch.tanh(self.l_linear(excitation.to(self.l_linear.weight.dtype))).squeeze(-1)


class AdaINResBlock1(nn.Module):
    """HiFi-GAN resblock with AdaIN before each conv and Snake activations."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...], style_dim: int) -> None:
        super().__init__()

        def conv(d: int) -> nn.Conv1d:
            return nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=d * (kernel_size - 1) // 2)

        self.convs1 = nn.ModuleList(conv(d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(1) for _ in dilations)
        self.adain1 = nn.ModuleList(AdaIN1d(style_dim, channels) for _ in dilations)
        self.adain2 = nn.ModuleList(AdaIN1d(style_dim, channels) for _ in dilations)
        self.alpha1 = nn.ParameterList(nn.Parameter(torch.ones(1, channels, 1)) for _ in dilations)
        self.alpha2 = nn.ParameterList(nn.Parameter(torch.ones(1, channels, 1)) for _ in dilations)

    def forward(self, x: torch.Tensor, style: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for c1, c2, n1, n2, a1, a2 in zip(self.convs1, self.convs2, self.adain1, self.adain2,
                                          self.alpha1, self.alpha2, strict=True):
            h = c1(snake(n1(x, style, mask), a1))
            x = masked(x + c2(snake(n2(h, style, mask), a2)), mask)
        return x


class Generator(nn.Module):
    """iSTFTNet generator: features at 2x frame rate -> audio, with the sine excitation
    entering every scale through `noise_convs` (strided to that scale) and `noise_res`."""

    def __init__(self, style_dim: int, resblock_kernel_sizes: tuple[int, ...],
                 resblock_dilation_sizes: tuple[tuple[int, ...], ...], upsample_rates: tuple[int, ...],
                 upsample_kernel_sizes: tuple[int, ...], upsample_initial_channel: int, n_fft: int, hop: int,
                 sample_rate: int) -> None:
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.num_kernels = len(resblock_kernel_sizes)
        self.upsample_rates = tuple(upsample_rates)
        self.source_upsample = math.prod(upsample_rates) * hop
        self.m_source = SineSource(sample_rate, self.source_upsample)
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        self.noise_convs = nn.ModuleList()
        self.noise_res = nn.ModuleList()
        spec_channels = n_fft + 2
        ch = upsample_initial_channel
        for i, (rate, kernel) in enumerate(zip(upsample_rates, upsample_kernel_sizes, strict=True)):
            self.ups.append(nn.ConvTranspose1d(ch, ch // 2, kernel, rate, padding=(kernel - rate) // 2))
            ch //= 2
            for k, d in zip(resblock_kernel_sizes, resblock_dilation_sizes, strict=True):
                self.resblocks.append(AdaINResBlock1(ch, k, tuple(d), style_dim))
            later = math.prod(upsample_rates[i + 1:])
            if i + 1 < len(upsample_rates):
                self.noise_convs.append(nn.Conv1d(spec_channels, ch, 2 * later, stride=later, padding=(later + 1) // 2))
                self.noise_res.append(AdaINResBlock1(ch, 7, (1, 3, 5), style_dim))
            else:
                self.noise_convs.append(nn.Conv1d(spec_channels, ch, 1))
                self.noise_res.append(AdaINResBlock1(ch, 11, (1, 3, 5), style_dim))
        self.conv_post = nn.Conv1d(ch, spec_channels, 7, padding=3)
        self.source_stft = SourceSTFT(n_fft, hop)
        self.head = SpectrumHead(n_fft, hop)

    def forward(self, x: torch.Tensor, style: torch.Tensor, f0: torch.Tensor, noise: torch.Tensor,
                frames: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, C, 2T], F0 [B, 2T], noise [B, T x 600, harmonics] -> audio [B, T x 600].
        `frames` [B]: each row's acoustic frames when rows are padded to T (None: no padding)."""
        length = None if frames is None else frames * 2 * self.source_upsample  # samples per row (F0 is 2 a frame)
        source = self.m_source(f0, noise).unsqueeze(1)
        har = self.source_stft(masked(source, frame_mask(length, source.shape[-1]))[:, 0], length)
        stft_frames = None if length is None else length // self.hop + 1
        har = masked(har, frame_mask(stft_frames, har.shape[-1]))
        last = len(self.ups) - 1
        rate = 1
        for i, up in enumerate(self.ups):
            rate *= self.upsample_rates[i]
            if i == last:
                scale_len, size = stft_frames, har.shape[-1]
            else:
                scale_len = None if frames is None else frames * 2 * rate
                size = x.shape[-1] * self.upsample_rates[i]
            mask = frame_mask(scale_len, size)
            source = self.noise_res[i](masked(self.noise_convs[i](har), mask), style, mask)
            x = up(F.leaky_relu(x, 0.1))
            if i == last:
                # One more frame at the start: the STFT of T samples has T / hop + 1 frames.
                x = F.pad(x, (1, 0), mode="reflect")
            x = masked(x, mask) + source
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            acc = blocks[0](x, style, mask)
            for block in blocks[1:]:
                acc = acc + block(x, style, mask)
            x = acc / self.num_kernels
        spec = self.conv_post(F.leaky_relu(x))
        return self.head(spec, stft_frames)


class _STFTStage(nn.Module):
    """An STFT-domain stage: its size, hop and periodic Hann window (not saved with the weights)."""

    window: torch.Tensor

    def __init__(self, n_fft: int, hop: int) -> None:
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft, periodic=True), persistent=False)


class SourceSTFT(_STFTStage):
    """The excitation's STFT as magnitude and phase [B, n_fft + 2, frames] (centred, reflect
    padded as `torch.stft` pads). Computed in FP32: cuFFT has no half-precision transform of
    this size. With `samples` [B], row b's signal ends at samples[b] and is reflected there, as
    it would be alone."""

    def forward(self, source: torch.Tensor, samples: torch.Tensor | None = None) -> torch.Tensor:
        dtype, source, half = source.dtype, source.float(), self.n_fft // 2
        window = self.window.float()
        if samples is None:
            spec = torch.stft(source, self.n_fft, self.hop, self.n_fft, window=window, return_complex=True)
        else:
            left = source[:, 1:half + 1].flip(-1)
            padded = torch.cat([left, source, source.new_zeros(source.shape[0], half)], dim=1)
            j = torch.arange(half, device=source.device)
            ends = samples.view(-1, 1)
            padded = padded.scatter(1, ends + half + j, source.gather(1, ends - 2 - j))
            spec = torch.stft(padded, self.n_fft, self.hop, self.n_fft, window=window, center=False,
                              return_complex=True)
        return torch.cat([spec.abs(), spec.angle()], dim=1).to(dtype)


class SpectrumHead(_STFTStage):
    """conv_post's output -> audio: log-magnitude and phase, then the inverse STFT (in FP32, as
    the STFT). With `frames` [B], each row's spectrum ends at frames[b] and its overlap-add is
    normalised by its own frames' windows, as `torch.istft` of that row alone would be."""

    def forward(self, spec: torch.Tensor, frames: torch.Tensor | None = None) -> torch.Tensor:
        spec, bins, window = spec.float(), self.n_fft // 2 + 1, self.window.float()
        complex_spec = torch.polar(torch.exp(spec[:, :bins]), torch.sin(spec[:, bins:]))
        return istft(complex_spec, self.n_fft, self.hop, window, frames)


class Decoder(nn.Module):
    """asr [B, C, T], F0 and N [B, 2T], decoder style [B, style_dim] -> audio [B, T * samples per frame]."""

    def __init__(self, dim_in: int, style_dim: int, generator: Generator) -> None:
        super().__init__()
        res_dim = 64
        wide = 1024 + 2 + res_dim
        self.encode = AdainResBlk1d(dim_in + 2, 1024, style_dim)
        self.decode = nn.ModuleList([
            AdainResBlk1d(wide, 1024, style_dim),
            AdainResBlk1d(wide, 1024, style_dim),
            AdainResBlk1d(wide, 1024, style_dim),
            AdainResBlk1d(wide, 512, style_dim, upsample=True),
        ])
        # F0 and N come at 2x frame rate: a stride-2 conv brings each to frame rate.
        self.F0_conv = nn.Conv1d(1, 1, 3, stride=2, padding=1)
        self.N_conv = nn.Conv1d(1, 1, 3, stride=2, padding=1)
        self.asr_res = nn.Sequential(nn.Conv1d(dim_in, res_dim, 1))
        self.generator = generator

    def forward(self, asr: torch.Tensor, f0: torch.Tensor, n: torch.Tensor, style: torch.Tensor,
                noise: torch.Tensor, frames: torch.Tensor | None = None) -> torch.Tensor:
        """`frames` [B]: each row's frame count when rows are padded to T (inputs zero past it;
        None: no padding). A padded row's audio equals its decode alone, zero past its end."""
        mask = frame_mask(frames, asr.shape[-1])
        mask2 = frame_mask(None if frames is None else 2 * frames, f0.shape[-1])
        dtype = asr.dtype  # F0 may come in FP32 while the rest runs in FP16: the sine source takes it as given
        f0_frames = masked(self.F0_conv(f0.unsqueeze(1).to(dtype)), mask)
        n_frames = masked(self.N_conv(n.unsqueeze(1).to(dtype)), mask)
        x = self.encode(torch.cat([asr, f0_frames, n_frames], dim=1), style, mask)
        skip = torch.cat([masked(self.asr_res(asr), mask), f0_frames, n_frames], dim=1)
        for block in self.decode:
            # Every block sees the skip features; the last one doubles the frame rate.
            x = block(torch.cat([x, skip], dim=1), style, mask, mask2 if block.upsample else None)
        audio = self.generator(x, style, f0, noise, frames).unsqueeze(1)
        samples = None if frames is None else frames * (audio.shape[-1] // asr.shape[-1])
        return masked(audio, frame_mask(samples, audio.shape[-1]))[:, 0]
