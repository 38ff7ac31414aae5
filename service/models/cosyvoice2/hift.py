"""CosyVoice2's vocoder, HiFT: an F0 predictor, a harmonic-plus-noise sine source and an
iSTFTNet generator that fuses the source's spectrum at every upsampling stage (HiFTNet,
arXiv 2309.09493), 80-band mel at 50 Hz in, 24 kHz audio out.

Loads the official `hift.pt` state dict as it is (weight norm in either spelling is folded
into plain convolutions). Every random draw (the harmonics' start phases, the source's
additive noise) comes from a `torch.Generator` the caller owns, in the order the official
`HiFTGenerator` draws them, so a seeded generator gives the official waveform."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from service.models.cuda_graphs import GraphCapturer, GraphTable, bucket
from service.models.spectral import istft
from service.models.weight_norm import fold_weight_norm


@dataclass(frozen=True)
class HiftConfig:
    """`hift` in the official cosyvoice2.yaml (CosyVoice2-0.5B's values as defaults)."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1  # sine amplitude
    nsf_sigma: float = 0.003  # noise std in voiced frames
    nsf_voiced_threshold: float = 10.0  # Hz
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_cond_channels: int = 512
    f0_layers: int = field(default=5, repr=False)

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsample_rates) * self.hop_len


def _snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Snake with the official guard against alpha = 0 (linear-scale alphas)."""
    a = alpha[None, :, None]
    return x + (1.0 / (a + 1e-9)) * torch.sin(x * a).pow(2)


class ResBlock(nn.Module):
    """Snake, dilated conv, Snake, conv, residual; once per dilation."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel, dilation=d, padding=(kernel * d - d) // 2) for d in dilations)
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2) for _ in dilations)
        self.alphas1 = nn.ParameterList(nn.Parameter(torch.ones(channels)) for _ in dilations)
        self.alphas2 = nn.ParameterList(nn.Parameter(torch.ones(channels)) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.alphas1, self.alphas2, strict=True):
            x = x + c2(_snake(c1(_snake(x, a1)), a2))
        return x


class F0Predictor(nn.Module):
    """Five conv+ELU layers and a linear head: |F0| in Hz per mel frame."""

    def __init__(self, config: HiftConfig) -> None:
        super().__init__()
        c = config.f0_cond_channels
        self.convs = nn.ModuleList(
            nn.Conv1d(config.in_channels if i == 0 else c, c, 3, padding=1) for i in range(config.f0_layers))
        self.classifier = nn.Linear(c, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = mel
        for conv in self.convs:
            x = F.elu(conv(x))
        return torch.abs(self.classifier(x.transpose(1, 2)).squeeze(-1))


# One generator for a whole batch, or one per row.
Generators = torch.Generator | Sequence[torch.Generator | None] | None


@dataclass(frozen=True)
class SourceNoise:
    """The sine source's random draws for one call, drawn before the rest of the vocoder runs
    (so that the rest can replay as a CUDA graph while each row draws from its own generator)."""

    start: torch.Tensor  # [B, harmonics + 1] start phases (the fundamental's is 0)
    noise: torch.Tensor  # [B, samples, harmonics + 1] standard normal


class SineSource(nn.Module):
    """F0 (at the audio rate) -> one excitation channel: the fundamental and its harmonics,
    their phase summed at the frame rate and interpolated back (as upstream's 24 kHz source
    does), silenced where unvoiced, plus noise, merged by a linear layer and tanh."""

    def __init__(self, config: HiftConfig) -> None:
        super().__init__()
        self.config = config
        self.merge = nn.Linear(config.nb_harmonics + 1, 1)

    def draw(self, rows: int, samples: int, generator: Generators, device: torch.device,
             dtype: torch.dtype) -> SourceNoise:
        """The draws of a call of `rows` rows of `samples` samples. One generator: the batch's
        draws in upstream's order for that batch; a sequence: row i's from `generator[i]`, in the
        order upstream draws them for row i alone."""
        gens = list(generator) if isinstance(generator, Sequence) else [generator]
        dim, n = self.config.nb_harmonics + 1, rows // len(gens)
        starts, noises = [], []
        for g in gens:
            starts.append(torch.rand(n, dim, generator=g, device=device, dtype=dtype))
            # Drawn into a tensor laid out as upstream's sines are (harmonic-major), as its randn_like
            # fills them: torch fills strided and contiguous tensors in different orders. Upstream also draws a
            # noise branch it never uses: drawn and dropped here too, so a session's generator stays
            # in step with upstream's RNG from one chunk to the next.
            noises.append(torch.empty(n, dim, samples, device=device, dtype=dtype).transpose(1, 2).normal_(generator=g))
            torch.empty(n, samples, 1, device=device, dtype=dtype).normal_(generator=g)
        start = torch.cat(starts)
        start[:, 0] = 0
        return SourceNoise(start, torch.cat(noises))

    def forward(self, f0: torch.Tensor, draws: SourceNoise) -> torch.Tensor:
        """f0: [B, T, 1] Hz at the audio rate, with `draw`'s draws for it -> [B, 1, T]."""
        cfg = self.config
        scale = cfg.samples_per_frame
        harmonics = torch.arange(1, cfg.nb_harmonics + 2, dtype=f0.dtype, device=f0.device)
        rad = (f0 * harmonics / cfg.sampling_rate) % 1
        rad[:, 0, :] = rad[:, 0, :] + draws.start
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / scale, mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad, dim=1) * 2 * math.pi
        phase = F.interpolate(phase.transpose(1, 2) * scale, scale_factor=float(scale), mode="linear").transpose(1, 2)
        sines = torch.sin(phase) * cfg.nsf_alpha
        uv = (f0 > cfg.nsf_voiced_threshold).to(f0.dtype)
        noise_amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3
        excitation = sines * uv + noise_amp * draws.noise
        return torch.tanh(self.merge(excitation)).transpose(1, 2)


class HiFT(nn.Module):
    """Mel [B, 80, T] -> audio [B, T * samples_per_frame]."""

    def __init__(self, config: HiftConfig) -> None:
        super().__init__()
        self.config = cfg = config
        self.f0_predictor = F0Predictor(cfg)
        self.source = SineSource(cfg)
        base = cfg.base_channels
        self.conv_pre = nn.Conv1d(cfg.in_channels, base, 7, padding=3)
        self.ups = nn.ModuleList(
            nn.ConvTranspose1d(base >> i, base >> (i + 1), k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True)))
        spec = cfg.n_fft + 2
        # The source's spectrum is brought down to each stage's rate: the product of the later
        # stages' upsampling rates.
        down = [math.prod(cfg.upsample_rates[i + 1:]) for i in range(len(cfg.upsample_rates))]
        self.source_downs = nn.ModuleList(
            nn.Conv1d(spec, base >> (i + 1), 1) if u == 1
            else nn.Conv1d(spec, base >> (i + 1), u * 2, u, padding=u // 2)
            for i, u in enumerate(down))
        self.source_resblocks = nn.ModuleList(
            ResBlock(base >> (i + 1), k, d) for i, (k, d) in
            enumerate(zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes, strict=True)))
        self.resblocks = nn.ModuleList(
            ResBlock(base >> (i + 1), k, d) for i in range(len(self.ups))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True))
        self.conv_post = nn.Conv1d(base >> len(self.ups), spec, 7, padding=3)
        # Periodic Hann computed in float64 and rounded once, as upstream's scipy window is.
        n = torch.arange(cfg.n_fft, dtype=torch.float64)
        window = (0.5 - 0.5 * torch.cos(2 * math.pi * n / cfg.n_fft)).float()
        self.window: torch.Tensor
        self.register_buffer("window", window, persistent=False)

    def draw(self, mel: torch.Tensor, generator: Generators) -> SourceNoise:
        """The sine source's draws for a call on `mel` [B, 80, T] (`SineSource.draw`)."""
        dtype = self.source.merge.weight.dtype
        return self.source.draw(mel.shape[0], mel.shape[2] * self.config.samples_per_frame, generator, mel.device,
                                dtype)

    def source_signal(self, mel: torch.Tensor, draws: SourceNoise, cache: torch.Tensor | None = None) -> torch.Tensor:
        """The excitation [B, 1, T * samples_per_frame] the generator fuses; `cache` (the end
        of the previous chunk's excitation, under the frames this chunk repeats) replaces its
        start, so the sine's phase runs on without a jump."""
        f0 = self.f0_predictor(mel.to(self.f0_predictor.classifier.weight.dtype))
        f0 = f0[:, :, None].repeat_interleave(self.config.samples_per_frame, dim=1)
        source = self.source(f0, draws)
        if cache is not None and cache.shape[2]:
            source[:, :, :cache.shape[2]] = cache
        return source

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """The STFT of the excitation and the inverse STFT run in FP32 whatever the model's
        precision (FFTs have no FP16 kernel on the CPU, and exp() of the magnitude needs the range)."""
        cfg = self.config
        dtype = self.window.dtype  # the model's precision (pinned modules cast their inputs to FP32 themselves)
        window = self.window.float()
        spec = torch.stft(source[:, 0].float(), cfg.n_fft, cfg.hop_len, cfg.n_fft, window=window, return_complex=True)
        s = torch.cat([spec.real, spec.imag], dim=1).to(dtype)
        x = self.conv_pre(mel.to(dtype))
        kernels = len(cfg.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, cfg.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s))
            xs = self.resblocks[i * kernels](x)
            for j in range(1, kernels):
                xs = xs + self.resblocks[i * kernels + j](x)
            x = xs / kernels
        x = self.conv_post(F.leaky_relu(x))  # the official post activation uses leaky_relu's default slope
        bins = cfg.n_fft // 2 + 1
        x = x.float()
        magnitude = torch.clip(torch.exp(x[:, :bins]), max=1e2)
        phase = torch.sin(x[:, bins:])
        audio = istft(torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase)),
                      cfg.n_fft, cfg.hop_len, window)
        return torch.clamp(audio, -cfg.audio_limit, cfg.audio_limit)

    def forward(self, mel: torch.Tensor, generator: Generators = None,
                cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Audio [B, samples] and the excitation it was made from [B, 1, samples]; `generator`:
        one for every row, or a sequence of one per row (each row then draws as alone)."""
        return self.synthesize(mel, self.draw(mel, generator), cache)

    def synthesize(self, mel: torch.Tensor, draws: SourceNoise,
                   cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the draws made (no random numbers drawn: a CUDA graph can replay it)."""
        source = self.source_signal(mel, draws, cache)
        return self.decode(mel, source), source


# A captured vocoder call: the graph, its static inputs (mel, source start, noise[, cache]) and its
# outputs (speech, source).
VocoderGraph = tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]


class GraphedHiFT:
    """A vocoder's calls replayed as CUDA graphs for the shapes `capture` was given: eagerly a
    call is about a thousand small kernel launches. The random draws stay outside the graphs,
    each row's from its own generator; rows are padded up to a power of two, frames are not
    (the convolutions would see the padding), so a shape not captured (or that cannot be)
    runs eagerly."""

    def __init__(self, hift: HiFT, capturer: GraphCapturer) -> None:
        self.hift, self.capturer = hift, capturer
        # Frames are not bucketed: a shape the start-up did not prepare runs eagerly.
        self._graphs: GraphTable[tuple[int, int, int], VocoderGraph] = GraphTable(
            capturer, "the vocoder", self._make, capture_while_serving=False)

    @staticmethod
    def _key(rows: int, frames: int, cache_samples: int) -> tuple[int, int, int]:
        return bucket(rows), frames, cache_samples

    def _call_key(self, rows: int, frames: int, cache: torch.Tensor | None) -> tuple[int, int, int]:
        return self._key(rows, frames, 0 if cache is None else cache.shape[2])

    def capture(self, rows: int, frames: int, cache_samples: int) -> None:
        """The graph for calls of `rows` rows (or fewer, down to the power of two below) of
        `frames` mel frames, with a cache of `cache_samples` excitation samples (0: none)."""
        self._graphs.prepare(self._key(rows, frames, cache_samples))

    def _make(self, key: tuple[int, int, int]) -> VocoderGraph | None:
        (b, frames, cache_samples), hift = key, self.hift
        dev = self.capturer.device
        dim, samples = hift.config.nb_harmonics + 1, frames * hift.config.samples_per_frame
        static: tuple[torch.Tensor, ...] = (torch.zeros(b, hift.config.in_channels, frames, device=dev),
                                            torch.zeros(b, dim, device=dev), torch.zeros(b, samples, dim, device=dev))
        if cache_samples:
            static += (torch.zeros(b, 1, cache_samples, device=dev),)

        def run(mel: torch.Tensor, start: torch.Tensor, noise: torch.Tensor,
                cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            return hift.synthesize(mel, SourceNoise(start, noise), cache)

        captured = self.capturer.capture_or_none(self._graphs.what, run, *static)
        return None if captured is None else (captured[0], static, captured[1])

    def graphed(self, rows: int, frames: int, cache: torch.Tensor | None) -> bool:
        """Whether a call of this shape replays a graph."""
        return self._graphs.has_graph(self._call_key(rows, frames, cache))

    def __call__(self, mel: torch.Tensor, generator: Generators,
                 cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`HiFT.forward`, replayed where its shape was captured."""
        b, _, frames = mel.shape
        key = self._call_key(b, frames, cache)
        found = self._graphs.get(key, key)
        draws = self.hift.draw(mel, generator)
        if found is None:
            return self.hift.synthesize(mel, draws, cache)
        graph, static, (speech, source) = found
        values = (mel, draws.start, draws.noise) + (() if cache is None else (cache,))
        for to, value in zip(static, values, strict=True):
            to[:b] = value
        graph.replay()
        # Copies: the next replay writes the outputs again, and callers keep parts of them.
        return speech[:b].clone(), source[:b].clone()


def hift_state_dict(official: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The official `HiFTGenerator` state dict (weight norm folded or not) under our names."""
    ours: dict[str, torch.Tensor] = {}
    for key, value in fold_weight_norm(official).items():
        name = key
        if key.startswith("f0_predictor.condnet."):  # Sequential of conv, ELU, ...: convs at even indices
            index, rest = key[len("f0_predictor.condnet."):].split(".", 1)
            name = f"f0_predictor.convs.{int(index) // 2}.{rest}"
        elif key.startswith("m_source.l_linear."):
            name = "source.merge." + key[len("m_source.l_linear."):]
        elif ".activations1." in key or ".activations2." in key:  # Snake alphas
            head, _, rest = key.replace(".activations", ".alphas", 1).partition(".alphas")
            name = f"{head}.alphas{rest.removesuffix('.alpha')}"
        ours[name] = value
    return ours


def load_hift(config: HiftConfig, official: Mapping[str, torch.Tensor]) -> HiFT:
    model = HiFT(config)
    model.load_state_dict(hift_state_dict(official), strict=True)
    return model.eval()
