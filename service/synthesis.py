"""In-process streaming synthesis: text -> utterances -> chunks of audio.

The acoustic stage (encoder + durations) runs once per utterance; the flow and
the vocoder run in chunks over the latent frames, each with enough context on
both sides (computed from the layers) that the trimmed chunk equals the same
span of a full decode. All randomness is drawn here from a seeded numpy
generator, so the same seed gives the same samples on any backend."""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from service.backends.base import Backend, DevicePriorOut, EncodeOut, guard_host
from service.models.vits.staged import StagedDecoder
from service.telemetry.ranges import stage
from service.text.frontend import PhonemizedSentence
from service.voices import Voice

# Durations closer than this to a whole frame are recomputed without batching (see acoustic_batch).
CEIL_AMBIGUITY_FRAMES = 1e-3


@dataclass(frozen=True)
class SynthesisParams:
    """Per-request controls; None means the voice's default."""

    speaker: int | str | None = None
    length_scale: float | None = None
    noise_scale: float | None = None
    noise_w: float | None = None
    seed: int | None = None
    precision: str = "fp32"
    custom_dictionary: Mapping[str, str] | None = None


@dataclass(frozen=True)
class ChunkSchedule:
    """Latent frames per vocoder chunk: small first (time to first audio), then
    growing (throughput: every chunk pays its receptive-field context), capped. Where a
    stream's text is cut into utterances is the segmenter's business (one rule, see
    service/text/segment.py), not the schedule's."""

    first_frames: int = 32  # 372 ms of audio at 22 kHz: room for the next chunk even with 8 sessions on 2 cores
    growth: float = 16.0  # 32 -> 512 -> 1024: chunk k+1 still finishes well before chunk k has played
    max_frames: int = 1024
    later_first_frames: int = 1024  # first chunk of a stream's later utterances (audio is already playing)
    flow_at_once_frames: int = 160  # utterances this short run the whole flow in their first call
    flow_piece_frames: int = 256  # after the first chunk, the staged flow runs at least this far ahead

    def __post_init__(self) -> None:
        if self.first_frames < 1 or self.max_frames < self.first_frames or self.growth < 1.0:
            raise ValueError(
                "chunk schedule needs first_frames >= 1, max_frames >= first_frames, growth >= 1"
            )

    def first_chunk(self, utterance_index: int) -> int:
        """Frames in an utterance's first chunk: small for the stream's first
        utterance (time to first audio), larger later (throughput)."""
        if utterance_index == 0:
            return self.first_frames
        return max(self.first_frames, min(self.later_first_frames, self.max_frames))

    def boundaries(self, total: int, first: int | None = None) -> list[int]:
        """Frame boundaries 0 = b0 < b1 < ... < bn = total."""
        out, pos, size = [0], 0, float(first or self.first_frames)
        while pos < total:
            pos = min(total, pos + int(size))
            if pos > out[-1] + self.first_frames and total - pos < self.first_frames:
                pos = total  # no runt chunk at the end: it would cost a whole context for a few frames
            out.append(pos)
            size = min(float(self.max_frames), size * self.growth)
        return out


@dataclass(frozen=True)
class WordTiming:
    word: str
    start: int  # samples from the start of the stream
    end: int


@dataclass
class AudioChunk:
    """One piece of audio as it leaves the synthesiser."""

    samples: np.ndarray  # float32 mono in [-1, 1]
    sample_rate: int
    offset: int  # stream position (samples) of samples[0]
    utterance: int  # index of the utterance in the stream
    words: list[WordTiming] = field(default_factory=list)  # on an utterance's first chunk
    precision: str = "fp32"
    fallback: bool = False  # a guard trip made us recompute this chunk in FP32
    last_in_utterance: bool = False


class PriorSample:
    """The prior sample z_p [C, T] = mean + sigma * noise, noise counter-based from `key`.

    Decoder steps draw their frames on the device from `mean`, `sigma` and `src` (it is a
    `service.models.family.Prior`); the host computes frames only where it needs them itself
    (staged decoding, shadow checks). Both get the same numbers for any split of the frames
    (`service.models.noise`). A prior made on a GPU stays there (`device_values`): the host
    copy of mean and sigma is made only if something on the host asks for it."""

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
    """Output of the acoustic stage for one sentence, ready for chunked decoding."""

    text: str
    phoneme_ids: list[int]
    prior: PriorSample
    durations: np.ndarray  # [T_ph] frames per phoneme id
    sid: int | None
    word_spans: list[tuple[str, int, int]]  # (word, start_sample, end_sample), utterance-relative

    @property
    def z_p(self) -> np.ndarray:
        """The whole prior sample [C, T] (drawn now where it was not yet)."""
        return self.prior.full()

    @property
    def frames(self) -> int:
        return self.prior.frames

    @property
    def sid_batch(self) -> np.ndarray | None:
        """The speaker as a batch of one, as backends take it (None: single speaker)."""
        return None if self.sid is None else np.asarray([self.sid], dtype=np.int64)


@dataclass
class AcousticJob:
    """One sentence waiting for the acoustic stage, with its own noise generator."""

    sentence: PhonemizedSentence
    sid: int | None
    params: SynthesisParams
    rng: np.random.Generator


@dataclass(frozen=True)
class Window:
    """Compute frames [lo, hi) of the input, keep outputs for frames [keep_lo, keep_hi)."""

    lo: int
    hi: int
    keep_lo: int
    keep_hi: int


class UtteranceDecoder:
    """Plans the flow and vocoder windows for one utterance, chunk by chunk."""

    def __init__(
        self, utt: Utterance, schedule: ChunkSchedule, flow_halo: int, voc_halo: int,
        first_frames: int | None = None, hop: int = 256,
    ) -> None:
        self.utt = utt
        self.hop = hop
        self.flow_at_once = schedule.flow_at_once_frames
        self.bounds = schedule.boundaries(utt.frames, first_frames)
        self.flow_halo = flow_halo
        self.voc_halo = voc_halo
        self.z = np.zeros_like(utt.z_p)
        self.z_done = 0
        self.index = 0  # next chunk

    @property
    def done(self) -> bool:
        return self.index >= len(self.bounds) - 1

    def next_windows(self) -> tuple[Window | None, Window]:
        """(flow window or None when z is already there, vocoder window)."""
        t = self.utt.frames
        a, b = self.bounds[self.index], self.bounds[self.index + 1]
        need_hi = min(t, b + self.voc_halo)
        flow = None
        if need_hi > self.z_done:
            # The first flow window covers just the first chunk (time to first
            # audio); the next one covers the rest of the utterance at once (the
            # flow is cheap per frame but pays its context on every call).
            keep_hi = need_hi if self.z_done == 0 and t > self.flow_at_once else t
            hi = min(t, keep_hi + self.flow_halo)
            flow = Window(max(0, self.z_done - self.flow_halo), hi, self.z_done, keep_hi)
        voc = Window(max(0, a - self.voc_halo), need_hi, a, b)
        return flow, voc

    def accept_flow(self, w: Window, z_window: np.ndarray) -> None:
        self.z[:, w.keep_lo : w.keep_hi] = z_window[:, w.keep_lo - w.lo : w.keep_hi - w.lo]
        self.z_done = w.keep_hi

    def trim_audio(self, w: Window, audio: np.ndarray, hop: int) -> np.ndarray:
        return audio[(w.keep_lo - w.lo) * hop : (w.keep_hi - w.lo) * hop]


def _given(out: EncodeOut | DevicePriorOut) -> EncodeOut | DevicePriorOut:
    """What `AcousticFlight.wait` is where the backend ran the stage already."""
    return out


@dataclass
class AcousticFlight:
    """An acoustic batch launched by `Synthesizer.acoustic_launch`: `.result()` waits for the
    device and makes the utterances."""

    synth: Synthesizer
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
        synth, jobs = self.synth, self.jobs
        with stage("acoustic.utterances"):
            out = []
            for i, job in enumerate(jobs):
                n = int(self.lengths[i])
                one = enc
                if len(jobs) > 1 and job.params.seed is not None and synth._ceil_is_ambiguous(enc.logw[i, 0, :n],
                                                                                              job.params):
                    # Batched kernels round differently from a batch of one (|d logw| ~1e-5). Where a
                    # duration sits that close to a whole frame, the batch of one decides, so a seeded
                    # sentence never gets a different length because of who it was batched with
                    # (unseeded sentences draw fresh noise anyway: nothing to reproduce).
                    one = synth._encode(self.ids[i : i + 1, :n], self.lengths[i : i + 1],
                                        self.dp_noise[i : i + 1, :, :n],
                                        None if self.sid is None else self.sid[i : i + 1], self.scales[i : i + 1])
                    row = 0
                else:
                    row = i
                out.append(synth._utterance(job, one, row, n))
        return out


class Synthesizer:
    """Text -> audio chunks on one backend, for one caller at a time."""

    def __init__(
        self, voice: Voice, backend: Backend, schedule: ChunkSchedule | None = None,
        shadow: ShadowSampler | None = None, staged: bool | None = None,
    ) -> None:
        self.voice = voice
        self.shadow = shadow
        # Staged decoding (each flow coupling's and generator stage's output kept between
        # chunks) where the backend offers it: FP32 only (no FP16 guard/fallback there).
        self.staged = backend.capabilities.staged_decoder if staged is None else staged
        self.backend = backend
        self.schedule = schedule or ChunkSchedule()
        self.hop = voice.hop_length
        # imported here: it needs torch, which the server's process (a user of this module's types) never loads
        from service.models.vits.receptive_field import flow_halo_frames, generator_halo_frames

        self.flow_halo = flow_halo_frames(voice.model.flow)
        self.voc_halo = generator_halo_frames(voice.model.dec)

    @property
    def sample_rate(self) -> int:
        return self.voice.info.sample_rate

    def prepare(self, text: str, params: SynthesisParams) -> list[Utterance]:
        """Frontend + acoustic stage for every sentence of `text`."""
        sid = self.voice.speaker_index(params.speaker)
        return [
            self.acoustic(s, sid, params, utterance_rng(params.seed, s.phoneme_ids))
            for s in self._sentences(text, params)
        ]

    def acoustic(
        self, sent: PhonemizedSentence, sid: int | None, params: SynthesisParams,
        rng: np.random.Generator,
    ) -> Utterance:
        """Acoustic stage for one sentence."""
        return self.acoustic_batch([AcousticJob(sent, sid, params, rng)])[0]

    def acoustic_batch(self, jobs: list[AcousticJob]) -> list[Utterance]:
        """Acoustic stage for several sentences in few backend calls (padded, masked): the
        backend may split a batch by length (`acoustic_split`), every group launched before any
        is waited for. Each job draws its noise from its own generator in the same order as a
        batch of one, so batching never changes which noise a sentence gets."""
        order = sorted(range(len(jobs)), key=lambda k: len(jobs[k].sentence.phoneme_ids))
        sizes = [len(jobs)]
        if self.backend.capabilities.acoustic_split:
            sizes = self.backend.acoustic_split(  # type: ignore[attr-defined]
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
        queued on the device and the caller goes on (the engine thread launches decoder steps);
        elsewhere it has run already."""
        info = self.voice.info
        lengths = np.asarray([len(j.sentence.phoneme_ids) for j in jobs], dtype=np.int64)
        t_max = int(lengths.max())
        ids = np.zeros((len(jobs), t_max), dtype=np.int64)
        dp_noise = np.zeros((len(jobs), 2, t_max), dtype=np.float32)
        for i, job in enumerate(jobs):
            n = int(lengths[i])
            ids[i, :n] = job.sentence.phoneme_ids
            noise_w = info.noise_w if job.params.noise_w is None else job.params.noise_w
            dp_noise[i, :, :n] = job.rng.standard_normal((2, n), dtype=np.float32) * np.float32(noise_w)
        sids = [j.sid for j in jobs]
        if any(s is None for s in sids) and any(s is not None for s in sids):
            raise ValueError("an acoustic batch mixes single- and multi-speaker jobs")
        sid_arr = None if sids[0] is None else np.asarray(sids, dtype=np.int64)
        scales = np.asarray([self._noise_scale(j.params) for j in jobs], dtype=np.float32)
        with stage("acoustic.encode"):
            if self.backend.capabilities.priors_on_device:
                wait = self.backend.encode_prior_async(  # type: ignore[attr-defined]
                    ids, lengths, dp_noise, sid_arr, scales).result
            else:
                wait = functools.partial(_given, self._encode(ids, lengths, dp_noise, sid_arr, scales))
        return AcousticFlight(self, jobs, ids, lengths, dp_noise, sid_arr, scales, wait)

    def _noise_scale(self, params: SynthesisParams) -> float:
        return self.voice.info.noise_scale if params.noise_scale is None else params.noise_scale

    def _encode(self, ids: np.ndarray, lengths: np.ndarray, dp_noise: np.ndarray, sid: np.ndarray | None,
                scales: np.ndarray) -> EncodeOut | DevicePriorOut:
        """The backend's acoustic stage; on a GPU the prior stays there (see `DevicePriorOut`)."""
        if self.backend.capabilities.priors_on_device:
            return self.backend.encode_prior(ids, lengths, dp_noise, sid, scales)  # type: ignore[attr-defined]
        return self.backend.encode(ids, lengths, dp_noise, sid)

    def _ceil_is_ambiguous(self, logw: np.ndarray, params: SynthesisParams) -> bool:
        length_scale = self.voice.info.length_scale if params.length_scale is None else params.length_scale
        w = np.exp(logw.astype(np.float64)) * length_scale
        frac = w - np.floor(w)
        return bool(np.any(np.minimum(frac, 1.0 - frac) < CEIL_AMBIGUITY_FRAMES))

    def _utterance(self, job: AcousticJob, enc: EncodeOut | DevicePriorOut, row: int, n: int) -> Utterance:
        """Durations, length regulation and the prior sample for one sentence (row `row` of `enc`)."""
        info, params, sent = self.voice.info, job.params, job.sentence
        length_scale = info.length_scale if params.length_scale is None else params.length_scale
        w = np.exp(enc.logw[row, 0, :n].astype(np.float32)) * np.float32(length_scale)
        durations = np.ceil(w).astype(np.int64)
        frames = max(1, int(durations.sum()))
        src = np.repeat(np.arange(n), durations)
        if src.size < frames:  # all-zero durations: one frame of the last phoneme
            src = np.full(frames, n - 1)
        key = int(job.rng.integers(0, 1 << 63))
        if isinstance(enc, DevicePriorOut):
            prior = PriorSample.on_device(enc.prior[row, :, :, :n], src, key)
        else:
            sigma = np.exp(enc.logs_p[row, :, :n].astype(np.float32)) * np.float32(self._noise_scale(params))
            prior = PriorSample(np.ascontiguousarray(enc.m_p[row, :, :n], dtype=np.float32), sigma, src, key)
        ends = np.concatenate([[0], np.cumsum(durations)]) * self.hop
        words = [(wd.text, int(ends[wd.start_id]), int(ends[wd.end_id])) for wd in sent.words]
        return Utterance(sent.text, list(sent.phoneme_ids), prior, durations, job.sid, words)

    def decode(
        self, utt: Utterance, precision: str = "fp32", first_frames: int | None = None,
        shadow: ShadowSampler | None = None,
    ) -> Iterator[tuple[np.ndarray, str, bool]]:
        """Chunked flow + vocoder for one utterance: yields (audio, precision used,
        fallback). `first_frames` overrides the schedule's first chunk (later
        utterances of a stream start bigger: audio is already playing).

        A chunk whose FP16 result holds NaN/Inf (latent or audio) is recomputed in
        FP32 from the same prior sample and context, and the rest of the utterance
        stays FP32."""
        if self.staged and precision == "fp32":
            yield from self._decode_staged(utt, first_frames)
            return
        dec = UtteranceDecoder(utt, self.schedule, self.flow_halo, self.voc_halo, first_frames, self.hop)
        sid = utt.sid_batch
        current = precision
        while not dec.done:
            flow_w, voc_w = dec.next_windows()
            tripped = False
            if flow_w is not None:
                z = self.backend.flow(utt.z_p[None, :, flow_w.lo : flow_w.hi], sid, current)
                tripped = not bool(np.isfinite(z).all())
                dec.accept_flow(flow_w, z[0])
            out = None
            if not tripped:
                out = self.backend.vocode(dec.z[None, :, voc_w.lo : voc_w.hi], sid, current)
                tripped = int(out.nonfinite[0]) > 0
            fallback = False
            if tripped and current != "fp32":
                audio = redo_chunk_fp32(self.backend, dec, voc_w, sid)
                current, fallback = "fp32", True
            else:
                assert out is not None
                audio = dec.trim_audio(voc_w, out.audio[0], self.hop)
                if shadow is not None and current != "fp32":
                    shadow.offer(self.backend, self.voice.info.name, utt.z_p, (voc_w.keep_lo, voc_w.keep_hi),
                                 (self.flow_halo, self.voc_halo), self.hop, sid, audio)
            dec.index += 1
            yield audio, current, fallback

    def staged_decoder(self, utt: Utterance) -> StagedDecoder:
        """A staged decoder for one utterance (FP32; backends with `decode_stage`)."""
        # Short utterances run the whole flow in their first call (it is cheap per frame
        # but pays for small calls); longer ones only what the first chunk needs.
        first_piece = utt.frames if utt.frames <= self.schedule.flow_at_once_frames else 0
        return StagedDecoder(
            self.backend, utt.z_p, utt.sid_batch, self.schedule.flow_piece_frames, first_piece,  # type: ignore[arg-type]
        )

    def _decode_staged(self, utt: Utterance, first_frames: int | None) -> Iterator[tuple[np.ndarray, str, bool]]:
        """FP32 chunks from the staged decoder (flow and vocoder, no recomputed halos)."""
        decoder = self.staged_decoder(utt)
        bounds = self.schedule.boundaries(utt.frames, first_frames)
        for a, b in itertools.pairwise(bounds):
            yield guard_host(decoder.audio(a * self.hop, b * self.hop)[None], "fp32").audio[0], "fp32", False

    def stream(self, text: str, params: SynthesisParams | None = None) -> Iterator[AudioChunk]:
        """Text -> audio chunks as soon as each is decoded."""
        params = params or SynthesisParams()
        offset = 0
        for index, sent in enumerate(self._sentences(text, params)):
            rng = utterance_rng(params.seed, sent.phoneme_ids)
            utt = self.acoustic(sent, self.voice.speaker_index(params.speaker), params, rng)
            words = [WordTiming(w, offset + s, offset + e) for w, s, e in utt.word_spans]
            first = self.schedule.first_chunk(index)
            n_chunks = len(self.schedule.boundaries(utt.frames, first)) - 1
            decoded = self.decode(utt, params.precision, first, self.shadow)
            for k, (audio, precision, fallback) in enumerate(decoded):
                yield AudioChunk(
                    samples=audio, sample_rate=self.sample_rate, offset=offset, utterance=index,
                    words=words if k == 0 else [], precision=precision, fallback=fallback,
                    last_in_utterance=k == n_chunks - 1,
                )
                offset += len(audio)

    def _sentences(self, text: str, params: SynthesisParams) -> Iterator[PhonemizedSentence]:
        """Phonemised sentences of `text` (the model-level tools' split: whole sentences)."""
        yield from (s for s in self.voice.frontend.sentences(text, params.custom_dictionary) if s.phoneme_ids)

    def synthesize(
        self, text: str, params: SynthesisParams | None = None
    ) -> tuple[np.ndarray, list[WordTiming]]:
        """Whole text -> (audio, word timings)."""
        pieces, words = [], []
        for chunk in self.stream(text, params):
            pieces.append(chunk.samples)
            words.extend(chunk.words)
        audio = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
        return audio.astype(np.float32, copy=False), words


def utterance_rng(seed: int | None, phoneme_ids: list[int]) -> np.random.Generator:
    """Noise for one utterance. Seeded: drawn from (seed, phoneme ids), so the same
    sentence with the same seed sounds the same wherever it occurs (and results
    can be cached); unseeded: fresh entropy."""
    if seed is None:
        return np.random.default_rng()
    digest = hashlib.blake2b(np.asarray(phoneme_ids, dtype=np.int64).tobytes(), digest_size=8).digest()
    return np.random.default_rng([seed, int.from_bytes(digest, "little")])


def fp32_latent(backend: Backend, dec: UtteranceDecoder, lo: int, hi: int, sid: np.ndarray | None) -> np.ndarray:
    """FP32 latent frames [lo, hi) straight from the prior sample, with full flow context."""
    t = dec.utt.frames
    a, b = max(0, lo - dec.flow_halo), min(t, hi + dec.flow_halo)
    z = backend.flow(dec.utt.z_p[None, :, a:b], sid, "fp32")[0]
    return z[:, lo - a : hi - a]


def fp32_chunk(
    backend: Backend, dec: UtteranceDecoder, voc: Window, sid: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """The chunk `voc` computed wholly in FP32: (latent window, trimmed audio)."""
    z = fp32_latent(backend, dec, voc.lo, voc.hi, sid)
    out = backend.vocode(z[None], sid, "fp32")
    audio = out.audio[0]
    if int(out.nonfinite[0]):  # the guard already counted them: no second scan
        audio = np.nan_to_num(audio, nan=0.0, posinf=0.0, neginf=0.0)  # never send non-finite samples
    return z, dec.trim_audio(voc, audio, dec.hop)


def redo_chunk_fp32(backend: Backend, dec: UtteranceDecoder, voc: Window, sid: np.ndarray | None) -> np.ndarray:
    """Guard tripped: recompute this chunk in FP32 and make the decoder continue in
    FP32 from here (later latent frames are recomputed, not reused)."""
    z, audio = fp32_chunk(backend, dec, voc, sid)
    dec.z[:, voc.lo : voc.hi] = z
    dec.z_done = voc.hi
    return audio


class ShadowSampler(Protocol):
    """Receives a sample of FP16 chunks to re-run in FP32 off the hot path."""

    def offer(
        self, backend: Backend, voice: str, z_p: np.ndarray, span: tuple[int, int], halos: tuple[int, int],
        hop: int, sid: np.ndarray | None, audio: np.ndarray,
    ) -> None: ...


__all__ = [
    "AudioChunk",
    "ChunkSchedule",
    "SynthesisParams",
    "Synthesizer",
    "Utterance",
    "WordTiming",
]


def default_backend(device: str) -> str:
    """ONNX Runtime on CPU (fastest there), PyTorch on CUDA."""
    return "torch" if device.startswith("cuda") else "onnxruntime"


def open_synthesizer(
    voice: str | None = None,
    *,
    voices_dir: str | None = None,
    backend: str = "auto",
    device: str = "cpu",
    threads: int | None = None,
    schedule: ChunkSchedule | None = None,
    cache_dir: str | None = None,
) -> Synthesizer:
    """Load a voice (built-in by default) on a backend, ready to synthesise."""
    from pathlib import Path

    from service.backends.registry import create_backend
    from service.voices import Voice, find_voice

    info = find_voice(voice, Path(voices_dir) if voices_dir else None)
    loaded = Voice(info)
    name = default_backend(device) if backend == "auto" else backend
    options: dict[str, object] = {}
    if threads:
        options["threads"] = threads
    if cache_dir and name == "onnxruntime":
        options["cache_dir"] = Path(cache_dir)
    return Synthesizer(loaded, create_backend(name, loaded, device, **options), schedule)
