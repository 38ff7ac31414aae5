"""A Piper/VITS voice on a backend, as the engine drives it (`service.models.family.VoiceRuntime`).

The acoustic stage (text encoder + stochastic durations) runs once per sentence over a batch;
its output is the prior each decoder frame is drawn from (mean + sigma x counter-based noise,
`service.models.noise`), so a streaming decoder in device slots, the staged CPU decoder and the
reference full decode all see the same numbers. Randomness comes from each sentence's own
seeded generator, so the same seed gives the same samples on any backend and in any batch."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.models.family import AcousticJob, ChunkSchedule, DecoderInput, SynthesisParams, VoiceInfo
from service.models.vits.backends.base import Backend, DevicePriorOut, EncodeOut
from service.models.vits.precision import VITS_PIN_CANDIDATES
from service.models.vits.staged import StagedDecoder
from service.models.vits.voice import Voice
from service.telemetry.ranges import stage

# Durations closer than this to a whole frame are recomputed without batching (see AcousticFlight).
CEIL_AMBIGUITY_FRAMES = 1e-3


class PriorSample:
    """The prior sample z_p [C, T] = mean + sigma * noise, noise counter-based from `key`.

    Decoder steps draw their frames on the device from `mean`, `sigma` and `src` (it is a
    `service.models.family.Prior`); the host computes frames only where it needs them itself
    (staged decoding, the reference decode). Both get the same numbers for any split of the
    frames. A prior made on a GPU stays there (`device_values`): the host copy of mean and
    sigma is made only if something on the host asks for it."""

    def __init__(self, mean: np.ndarray | None, sigma: np.ndarray | None, src: np.ndarray, key: int,
                 device_values: Any = None) -> None:
        self._mean = mean  # [C, T_ph] per phoneme id
        self._sigma = sigma  # [C, T_ph] noise scale per phoneme id (0: no noise)
        self.device_values = device_values  # [2, C, T_ph] (mean, sigma) as a device tensor, or None
        self.src = src  # [T] phoneme id of each frame
        self.key = key
        self._buf: np.ndarray | None = None  # the host copy, made on first use

    @classmethod
    def fixed(cls, z_p: np.ndarray) -> PriorSample:
        """A prior sample given whole (tests, tools)."""
        z = np.ascontiguousarray(z_p, dtype=np.float32)
        return cls(z, np.zeros_like(z), np.arange(z.shape[1]), 0)

    @classmethod
    def on_device(cls, values: Any, src: np.ndarray, key: int) -> PriorSample:
        """A prior whose mean and sigma (`values`, [2, C, T_ph]) are a device tensor."""
        return cls(None, None, src, key, device_values=values)

    def _host(self) -> tuple[np.ndarray, np.ndarray]:
        if self._mean is None or self._sigma is None:
            values = self.device_values.float().cpu().numpy()
            self._mean, self._sigma = np.ascontiguousarray(values[0]), np.ascontiguousarray(values[1])
        return self._mean, self._sigma

    @property
    def mean(self) -> np.ndarray:
        return self._host()[0]

    @property
    def sigma(self) -> np.ndarray:
        return self._host()[1]

    @property
    def channels(self) -> int:
        return int(self.device_values.shape[1] if self._mean is None else self._mean.shape[0])

    @property
    def phonemes(self) -> int:
        """Columns of mean and sigma (phoneme ids)."""
        return int(self.device_values.shape[2] if self._mean is None else self._mean.shape[1])

    @property
    def frames(self) -> int:
        return len(self.src)

    def parts(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(mean, sigma) of frames [lo, hi), clipped to the end."""
        src = self.src[lo:hi]
        mean, sigma = self._host()
        return mean[:, src], sigma[:, src]

    def full(self) -> np.ndarray:
        """The whole sample on the host (computed once)."""
        if self._buf is None:
            import torch

            from service.models.noise import counter_normal

            noise = counter_normal(torch.tensor([self.key]), torch.tensor([0]), self.channels, self.frames)[0]
            mean, sigma = self.parts(0, self.frames)
            self._buf = (mean + sigma * noise.numpy()).astype(np.float32)
        return self._buf


@dataclass
class Utterance:
    """One sentence after the acoustic stage (a `service.models.family.DecoderInput`)."""

    text: str
    phoneme_ids: list[int]
    prior: PriorSample
    durations: np.ndarray  # [T_ph] frames per phoneme id
    sid: int | None
    word_spans: list[tuple[str, int, int]]  # (word, start_sample, end_sample), utterance-relative

    @property
    def frames(self) -> int:
        return self.prior.frames

    @property
    def sid_batch(self) -> np.ndarray | None:
        """The speaker as a batch of one, as backends take it (None: single speaker)."""
        return None if self.sid is None else np.asarray([self.sid], dtype=np.int64)


@dataclass
class AcousticFlight:
    """An acoustic batch launched by `VitsRuntime.acoustic_launch`: `.result()` waits for the
    device and makes the utterances."""

    runtime: VitsRuntime
    jobs: list[AcousticJob]
    ids: np.ndarray
    lengths: np.ndarray
    dp_noise: np.ndarray
    sid: np.ndarray | None
    scales: np.ndarray
    wait: Callable[[], EncodeOut | DevicePriorOut]  # the backend's output, once the device has made it

    def result(self) -> list[Utterance]:
        with stage("acoustic.wait"):
            enc = self.wait()
        runtime, jobs = self.runtime, self.jobs
        with stage("acoustic.utterances"):
            out = []
            for i, job in enumerate(jobs):
                n = int(self.lengths[i])
                one = enc
                if len(jobs) > 1 and job.params.seed is not None and runtime.ceil_is_ambiguous(enc.logw[i, 0, :n],
                                                                                                job.params):
                    # Batched kernels round differently from a batch of one (|d logw| ~1e-5). Where a
                    # duration sits that close to a whole frame, the batch of one decides, so a seeded
                    # sentence never gets a different length because of who it was batched with
                    # (unseeded sentences draw fresh noise anyway: nothing to reproduce).
                    one = runtime.encode(self.ids[i : i + 1, :n], self.lengths[i : i + 1],
                                         self.dp_noise[i : i + 1, :, :n],
                                         None if self.sid is None else self.sid[i : i + 1], self.scales[i : i + 1])
                    row = 0
                else:
                    row = i
                out.append(runtime.utterance(job, one, row, n))
        return out


def _given(out: EncodeOut | DevicePriorOut) -> EncodeOut | DevicePriorOut:
    """What `AcousticFlight.wait` is where the backend ran the stage already."""
    return out


class VitsRuntime:
    """A Piper voice on one backend (driven by one thread)."""

    def __init__(self, voice: Voice, backend: Backend, schedule: ChunkSchedule | None = None) -> None:
        self.voice = voice
        self.info: VoiceInfo = voice.info
        self.backend = backend
        self.backend_name = backend.name
        self.capabilities = backend.capabilities
        self.fp32_pins = backend.fp32_pins
        self.pin_candidates = VITS_PIN_CANDIDATES if "fp16" in backend.supported_precisions() else ()
        self.schedule = schedule or ChunkSchedule()
        self._noise_scale = voice.info.option("noise_scale")
        self._noise_w = voice.info.option("noise_w")

    @property
    def sample_rate(self) -> int:
        return self.info.sample_rate

    @property
    def hop(self) -> int:
        return self.voice.hop_length

    def precisions(self) -> tuple[str, ...]:
        return tuple(self.backend.supported_precisions())

    def prepare(self, max_batch: int) -> None:
        if self.capabilities.encoder_graphs:
            self.backend.capture_encoder(max_batch)

    # --- acoustic stage --------------------------------------------------------------------------

    def acoustic_batch(self, jobs: list[AcousticJob]) -> list[Utterance]:
        """Acoustic stage for several sentences in few backend calls (padded, masked): the
        backend may split a batch by length (`acoustic_split`), every group launched before any
        is waited for. Each job draws its noise from its own generator in the same order as a
        batch of one, so batching never changes which noise a sentence gets."""
        order = sorted(range(len(jobs)), key=lambda k: len(jobs[k].sentence.phoneme_ids))
        sizes = [len(jobs)]
        if self.capabilities.acoustic_split:
            sizes = self.backend.acoustic_split(
                [len(jobs[k].sentence.phoneme_ids) for k in order])
        if len(sizes) == 1:
            return self.acoustic_launch(jobs).result()
        flights, start = [], 0
        for size in sizes:
            group = order[start : start + size]
            flights.append((group, self.acoustic_launch([jobs[k] for k in group])))
            start += size
        out: list[Utterance | None] = [None] * len(jobs)
        for group, flight in flights:
            for k, utt in zip(group, flight.result(), strict=True):
                out[k] = utt
        utts = [u for u in out if u is not None]
        assert len(utts) == len(jobs), "every job is in exactly one group"
        return utts

    def acoustic_launch(self, jobs: list[AcousticJob]) -> AcousticFlight:
        """`acoustic_batch`, its result waited for later (`.result()`): on a GPU the stage is
        queued on the device and the caller goes on; elsewhere it has run already."""
        lengths = np.asarray([len(j.sentence.phoneme_ids) for j in jobs], dtype=np.int64)
        t_max = int(lengths.max())
        ids = np.zeros((len(jobs), t_max), dtype=np.int64)
        dp_noise = np.zeros((len(jobs), 2, t_max), dtype=np.float32)
        for i, job in enumerate(jobs):
            n = int(lengths[i])
            ids[i, :n] = job.sentence.phoneme_ids
            noise_w = job.params.option(self._noise_w)
            dp_noise[i, :, :n] = job.rng.standard_normal((2, n), dtype=np.float32) * np.float32(noise_w)
        sids = [j.sid for j in jobs]
        if any(s is None for s in sids) and any(s is not None for s in sids):
            raise ValueError("an acoustic batch mixes single- and multi-speaker jobs")
        sid_arr = None if sids[0] is None else np.asarray(sids, dtype=np.int64)
        scales = np.asarray([j.params.option(self._noise_scale) for j in jobs], dtype=np.float32)
        with stage("acoustic.encode"):
            if self.capabilities.priors_on_device:
                wait = self.backend.encode_prior_async(
                    ids, lengths, dp_noise, sid_arr, scales).result
            else:
                wait = functools.partial(_given, self.encode(ids, lengths, dp_noise, sid_arr, scales))
        return AcousticFlight(self, jobs, ids, lengths, dp_noise, sid_arr, scales, wait)

    def encode(self, ids: np.ndarray, lengths: np.ndarray, dp_noise: np.ndarray, sid: np.ndarray | None,
               scales: np.ndarray) -> EncodeOut | DevicePriorOut:
        """The backend's acoustic stage; on a GPU the prior stays there (see `DevicePriorOut`)."""
        if self.capabilities.priors_on_device:
            return self.backend.encode_prior(ids, lengths, dp_noise, sid, scales)
        return self.backend.encode(ids, lengths, dp_noise, sid)

    def length_scale(self, params: SynthesisParams) -> float:
        return self.info.length_scale if params.length_scale is None else params.length_scale

    def ceil_is_ambiguous(self, logw: np.ndarray, params: SynthesisParams) -> bool:
        w = np.exp(logw.astype(np.float64)) * self.length_scale(params)
        frac = w - np.floor(w)
        return bool(np.any(np.minimum(frac, 1.0 - frac) < CEIL_AMBIGUITY_FRAMES))

    def utterance(self, job: AcousticJob, enc: EncodeOut | DevicePriorOut, row: int, n: int) -> Utterance:
        """Durations, length regulation and the prior sample for one sentence (row `row` of `enc`)."""
        params, sent = job.params, job.sentence
        w = np.exp(enc.logw[row, 0, :n].astype(np.float32)) * np.float32(self.length_scale(params))
        durations = np.ceil(w).astype(np.int64)
        frames = max(1, int(durations.sum()))
        src = np.repeat(np.arange(n), durations)
        if src.size < frames:  # all-zero durations: one frame of the last phoneme
            src = np.full(frames, n - 1)
        key = int(job.rng.integers(0, 1 << 63))
        if isinstance(enc, DevicePriorOut):
            prior = PriorSample.on_device(enc.prior[row, :, :, :n], src, key)
        else:
            sigma = np.exp(enc.logs_p[row, :, :n].astype(np.float32)) * np.float32(params.option(self._noise_scale))
            prior = PriorSample(np.ascontiguousarray(enc.m_p[row, :, :n], dtype=np.float32), sigma, src, key)
        ends = np.concatenate([[0], np.cumsum(durations)]) * self.hop
        words = [(wd.text, int(ends[wd.start_id]), int(ends[wd.end_id])) for wd in sent.words]
        return Utterance(sent.text, list(sent.phoneme_ids), prior, durations, job.sid, words)

    # --- decoding --------------------------------------------------------------------------------

    def streaming_decoder(self, precision: str, slots: int, *, max_rows: int, graphs: bool,
                          graph_frames: tuple[int, ...]) -> Any:
        return self.backend.streaming_decoder(
            precision, slots, max_rows=max_rows, graphs=graphs, graph_frames=graph_frames)

    def streaming_lag(self) -> int:
        return int(self.backend.streaming_lag())

    def guard_async(self, device_audio: Any) -> Any:
        return self.backend.guard_async(device_audio)

    def utterance_decoder(self, utt: DecoderInput, precision: str) -> StagedDecoder:
        """A staged decoder for one utterance: INT8 where the session asked for it (the backend
        offers it only when loaded so), else FP32 (the staged path has no FP16)."""
        assert isinstance(utt, Utterance), "a VITS voice decodes its own acoustic stage's output"
        return StagedDecoder(self.backend, utt.prior.full(), utt.sid_batch, self.schedule.flow_piece_frames,
                             "int8" if precision == "int8" else "fp32")

    def reference(self, utt: DecoderInput, precision: str = "fp32") -> np.ndarray:
        """The flow over the whole prior sample, then the vocoder over the whole latent: what
        every chunked decode must equal."""
        assert isinstance(utt, Utterance), "a VITS voice decodes its own acoustic stage's output"
        sid = utt.sid_batch
        z = self.backend.flow(utt.prior.full()[None], sid, precision)
        out = self.backend.vocode(z, sid, precision)
        return out.audio[0]

    tokens = None  # no autoregressive stage: the acoustic stage gives the whole prior
