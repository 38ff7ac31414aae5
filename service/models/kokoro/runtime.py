"""A Kokoro voice on the torch backend, as the engine drives it (`service.models.family.VoiceRuntime`).

The acoustic stage (PL-BERT, prosody predictor, text encoder) runs per sentence in FP32 and gives
the decoder's per-frame input: 512 text features, two F0 and two energy values per 25 ms frame,
held as frame columns (`FrameColumns`, a `Prior` with no noise) with the sentence's style row (the
voice pack's row for its length, as the official pipeline picks it).

The decoder (iSTFTNet with a sine source) cannot be cut into exact chunks: its AdaIN layers
normalise over the whole utterance at every rate (`service.models.kokoro.model`). So an utterance
is decoded whole at its first step and its later chunks are slices of that audio: the slot
decoder (`KokoroSlots`, on the CPU as on CUDA) decodes the utterances that start in a step as one
padded batch, each row normalised over its own frames, in FP32 or FP16 with FP32 pins; the guard
and the engine's FP32 redo work as for any slot decoder. Streaming comes from the text side: the
engine's sentences.

The sine source's noise is counter-based (`service.models.noise.counter_normal`) from the
utterance's key, so a seed gives the same audio in any batch, on any device."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.models.family import (
    AcousticJob,
    Capabilities,
    ChunkSchedule,
    DecoderInput,
    PendingAudio,
    Prior,
    StepRows,
    UtteranceDecoder,
    VoiceInfo,
)
from service.models.kokoro.model import AcousticOutput, KokoroModel
from service.models.kokoro.voices import VOICE_ROWS
from service.models.noise import counter_normal

# Module-name patterns (fnmatch, over `KokoroModel`) kept in FP32 in the FP16 decoder. The
# acoustic stage always runs in FP32 (durations are rounded: one flip moves every later frame).
# The instance norms take their statistics in FP32 and the STFT and inverse STFT run in FP32
# whatever the precision (`layers.adaptive_instance_norm`, `istftnet.SourceSTFT`/`SpectrumHead`). Why each:
# - decoder.generator.m_source: the sine source's phase is a cumulative sum of F0 over the
#   utterance; FP16 keeps 11 bits of a phase that grows to thousands of radians.
# - decoder.generator.conv_post: its output goes through exp() (the magnitude).
# `cadenza precision sensitivity --voice kokoro-af_heart` measures each on the served path.
KOKORO_FP32_PINS: tuple[str, ...] = ("decoder.generator.m_source", "decoder.generator.conv_post")
KOKORO_PIN_CANDIDATES: tuple[str, ...] = (
    "decoder.F0_conv", "decoder.N_conv", "decoder.asr_res", "decoder.encode", "decoder.decode.*",
    "decoder.generator.m_source", "decoder.generator.noise_convs.*", "decoder.generator.noise_res.*",
    "decoder.generator.ups.*", "decoder.generator.resblocks.*", "decoder.generator.conv_post",
)
# Frames (rows x padded length) one decoder call takes; more starting utterances wait a call.
MAX_CALL_FRAMES = 8192


class FrameColumns:
    """Per-frame decoder input as a `Prior`: column t is frame t (no noise)."""

    def __init__(self, values: np.ndarray, key: int, style: torch.Tensor) -> None:
        self.values = values  # [C, T]
        self.key = key
        self.style = style  # [256] the voice pack's row for the sentence
        self.src = np.arange(values.shape[1])
        self.device_values = None

    @property
    def mean(self) -> np.ndarray:
        return self.values

    @cached_property
    def sigma(self) -> np.ndarray:
        return np.zeros_like(self.values)

    @property
    def frames(self) -> int:
        return int(self.values.shape[1])

    @property
    def phonemes(self) -> int:
        return int(self.values.shape[1])


@dataclass
class KokoroUtterance:
    """One sentence after the acoustic stage (a `service.models.family.DecoderInput`)."""

    text: str
    phoneme_ids: list[int]
    prior: FrameColumns  # rows: text features, then F0 (2 per frame), then energy (2 per frame); its style row
    durations: np.ndarray  # frames per token, the boundary tokens included
    word_spans: list[tuple[str, int, int]]
    sid: int | None = None

    @property
    def frames(self) -> int:
        return self.prior.frames

    @property
    def style(self) -> torch.Tensor:
        return self.prior.style


def decode_priors(model: KokoroModel, priors: list[FrameColumns], device: torch.device,
                  dtype: torch.dtype) -> list[torch.Tensor]:
    """Whole utterances as one padded batch -> each one's audio [frames x hop] on `device`,
    equal to its decode alone; its source noise counter-based from its key."""
    frames = [p.frames for p in priors]
    top = max(frames)
    values = torch.zeros(len(priors), priors[0].values.shape[0], top)
    for row, prior in enumerate(priors):
        values[row, :, : prior.frames] = torch.from_numpy(prior.values)
    values = values.to(device, non_blocking=True)
    hidden = values.shape[1] - 4
    asr = values[:, :hidden].to(dtype)
    # F0 and energy: two values per frame, stored as two rows each -> [B, 2T]. F0 stays FP32: the
    # sine source sums it into a phase over the utterance, and FP16 steps of F0 (1/4 Hz at 300 Hz)
    # drift that phase audibly.
    f0, n = (values[:, row : row + 2].transpose(1, 2).reshape(len(priors), -1) for row in (hidden, hidden + 2))
    n = n.to(dtype)
    keys = torch.tensor([p.key for p in priors], dtype=torch.int64, device=device)
    noise = counter_normal(keys, torch.zeros_like(keys), model.source_harmonics, top * model.samples_per_frame)
    style = torch.stack([p.style for p in priors]).to(device, dtype)
    # No masks where no row is padded (one utterance, or equal lengths): the same audio, fewer passes.
    lengths = None if min(frames) == top else torch.tensor(frames, device=device)
    audio = model.decode(asr, f0, n, style, noise.transpose(1, 2).to(dtype), frames=lengths)
    hop = model.samples_per_frame
    return [audio[row, : f * hop] for row, f in enumerate(frames)]


class KokoroSlots:
    """The slot decoder (`service.models.family.StreamingDecoder`): an utterance is decoded whole
    in the first step that covers it, together with every other utterance starting in that step
    (one padded batch per `MAX_CALL_FRAMES`); each step then hands out the next frames of each
    row's audio, kept on the device until the slot is freed."""

    lag = 0

    def __init__(self, runtime: KokoroRuntime, precision: str, slots: int) -> None:
        self.runtime, self.precision, self.capacity = runtime, precision, slots
        self.hop = runtime.hop
        self.step_seconds: dict[tuple[int, int], float] = {}
        self._priors: dict[int, FrameColumns] = {}
        self._audio: dict[int, torch.Tensor] = {}

    def start(self, slot: int, prior: Prior) -> bool:
        assert isinstance(prior, FrameColumns), "a Kokoro voice decodes its own acoustic stage's output"
        self._priors[slot] = prior
        self._audio.pop(slot, None)
        return True

    def free(self, slot: int) -> None:
        self._priors.pop(slot, None)
        self._audio.pop(slot, None)

    def capture_all(self) -> None:
        """No CUDA graphs: one call decodes whole utterances, its shapes vary with them."""

    @torch.inference_mode()
    def step(self, rows: StepRows) -> torch.Tensor:
        starting = [slot for slot in dict.fromkeys(rows.slots) if slot not in self._audio]
        model, dtype = self.runtime.decoder_model(self.precision)
        for call in _calls([self._priors[slot] for slot in starting]):
            slots, priors = [starting[i] for i in call], [self._priors[starting[i]] for i in call]
            for slot, audio in zip(slots, decode_priors(model, priors, self.runtime.device, dtype), strict=True):
                self._audio[slot] = audio
        size = rows.frames * self.hop
        out = torch.zeros(len(rows.slots), size, device=self.runtime.device, dtype=dtype)
        for row, (slot, fed) in enumerate(zip(rows.slots, rows.fed, strict=True)):
            piece = self._audio[slot][fed * self.hop : fed * self.hop + size]
            out[row, : piece.shape[0]] = piece
        return out


def _calls(priors: list[FrameColumns]) -> list[list[int]]:
    """Indices of `priors` in decoder calls: by length (little padding), each call's rows x
    longest within MAX_CALL_FRAMES (one row alone may exceed it)."""
    order = sorted(range(len(priors)), key=lambda i: priors[i].frames)
    calls: list[list[int]] = []
    for i in order:
        if calls and (len(calls[-1]) + 1) * priors[i].frames <= MAX_CALL_FRAMES:
            calls[-1].append(i)
        else:
            calls.append([i])
    return calls


_LOGGER = logging.getLogger(__name__)
_MODELS: dict[tuple[str, str], KokoroModel] = {}
_MODELS_LOCK = threading.Lock()


def load_model(model_path: Path) -> KokoroModel:
    """The model (FP32, eval, on the CPU) from any Kokoro model file (`weights.model_state_dict`).
    Every weight must come from the file, except ALBERT's pooler (KModel never runs it; the int8
    graph drops it), which keeps its init; a file that is not Kokoro v1.0 is a one-line error.
    Entries the model has no place for (a checkpoint's stale buffers, such as an older
    transformers' `position_ids`) are left out, as KModel's own loader leaves them."""
    from service.models.kokoro.weights import model_state_dict

    model = KokoroModel()
    state = {k: v for k, v in model.state_dict().items() if k.startswith("bert.pooler.")}
    state.update(model_state_dict(model_path))
    try:
        result = model.load_state_dict(state, strict=False)  # weight-normed pairs are folded on the way in
    except RuntimeError as exc:  # a shape that is not Kokoro v1.0's
        detail = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), str(exc))
        raise ValueError(f"{model_path}: not the Kokoro-82M v1.0 weights ({detail})") from None
    if result.missing_keys:
        raise ValueError(f"{model_path}: not the Kokoro-82M v1.0 weights ({len(result.missing_keys)} missing, "
                         f"e.g. {', '.join(result.missing_keys[:3])})")
    if result.unexpected_keys:
        _LOGGER.info("%s: left out %d entries the model has no use for: %s", model_path,
                     len(result.unexpected_keys), ", ".join(result.unexpected_keys[:5]))
    return model.eval()


def shared_model(model_path: Path, device: str) -> KokoroModel:
    """One model per file and device, whichever voices use it (a voice is only its style table)."""
    key = (str(model_path.resolve()), device)
    with _MODELS_LOCK:
        model = _MODELS.get(key)
        if model is None:
            model = _MODELS[key] = load_model(model_path).to(device)
    return model


class KokoroRuntime:
    """A Kokoro voice on torch for one engine thread: FP32 everywhere, FP16 with FP32 pins on CUDA."""

    backend_name = "torch"
    pin_candidates = KOKORO_PIN_CANDIDATES

    def __init__(self, info: VoiceInfo, device: str, schedule: ChunkSchedule | None = None,
                 pins: tuple[str, ...] = KOKORO_FP32_PINS) -> None:
        from service.models.kokoro.weights import load_voice_pack

        self.info = info
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.capabilities = Capabilities(slot_decoder=True, asynchronous=cuda)
        self.schedule = schedule or ChunkSchedule()
        self.model = shared_model(info.config_path, device)
        self.fp32_pins = tuple(pins)
        self._half: KokoroModel | None = None
        self.pack = load_voice_pack(info.model_path).to(self.device)  # [510, 1, 256]

    @property
    def sample_rate(self) -> int:
        return self.info.sample_rate

    @property
    def hop(self) -> int:
        return self.model.samples_per_frame

    def precisions(self) -> tuple[str, ...]:
        return ("fp32", "fp16") if self.device.type == "cuda" else ("fp32",)

    def decoder_model(self, precision: str) -> tuple[KokoroModel, torch.dtype]:
        """The model that decodes in `precision`: the FP32 one, or its FP16 twin with the pins
        (made on first use; only its decoder runs)."""
        if precision not in self.precisions():
            raise ValueError(f"Kokoro on {self.device.type} runs {' or '.join(self.precisions())}, not {precision}")
        if precision == "fp32":
            return self.model, torch.float32
        if self._half is None:
            from service.models.mixed_precision import to_mixed_precision

            self._half = to_mixed_precision(self.model, self.fp32_pins, torch.float16)
        return self._half, torch.float16

    def prepare(self, max_batch: int) -> None:
        """Nothing is captured before serving."""

    @torch.inference_mode()
    def acoustic_batch(self, jobs: list[AcousticJob]) -> list[KokoroUtterance]:
        """The sentences padded into one batch (`KokoroModel.acoustic_batch`: each row as alone).
        The ids hold the boundary tokens already (the frontend adds them); each style row is the
        pack's row for the sentence's phoneme count less one, as the official pipeline picks it."""
        if not jobs:
            return []
        top = max(len(job.sentence.phoneme_ids) for job in jobs)
        ids = torch.zeros(len(jobs), top, dtype=torch.long)
        for b, job in enumerate(jobs):
            ids[b, : len(job.sentence.phoneme_ids)] = torch.tensor(job.sentence.phoneme_ids)
        lengths = torch.tensor([len(job.sentence.phoneme_ids) for job in jobs])
        styles = torch.stack([self.pack[min(max(len(job.sentence.phonemes) - 1, 0), VOICE_ROWS - 1), 0]
                              for job in jobs])
        scales = [self.info.length_scale if job.params.length_scale is None else job.params.length_scale
                  for job in jobs]
        speeds = torch.tensor([1.0 / s for s in scales])
        outs = self.model.acoustic_batch(ids.to(self.device), lengths.to(self.device), styles,
                                         speeds.to(self.device))
        return [self._utterance(job, out, style) for job, out, style in zip(jobs, outs, styles, strict=True)]

    def _utterance(self, job: AcousticJob, out: AcousticOutput, style: torch.Tensor) -> KokoroUtterance:
        frames = out.asr.shape[-1]
        values = torch.cat([out.asr[0], out.f0[0].view(frames, 2).T, out.n[0].view(frames, 2).T])
        durations = out.durations.cpu().numpy()
        ends = np.concatenate([[0], np.cumsum(durations)]) * self.hop  # token k starts at ends[k]
        words = [(w.text, int(ends[w.start_id]), int(ends[w.end_id])) for w in job.sentence.words]
        key = int(job.rng.integers(0, 1 << 63))
        return KokoroUtterance(job.sentence.text, list(job.sentence.phoneme_ids),
                               FrameColumns(values.float().cpu().numpy(), key, style), durations, words)

    def utterance_decoder(self, utt: DecoderInput, precision: str) -> UtteranceDecoder:
        raise ValueError("Kokoro voices decode through their slot decoder (--decoder auto or slots)")

    @torch.inference_mode()
    def reference(self, utt: DecoderInput, precision: str = "fp32") -> np.ndarray:
        """The whole utterance decoded alone (a batch of one), its source noise from its key."""
        assert isinstance(utt, KokoroUtterance), "a Kokoro voice decodes its own acoustic stage's output"
        model, dtype = self.decoder_model(precision)
        return decode_priors(model, [utt.prior], self.device, dtype)[0].float().cpu().numpy()

    def streaming_decoder(self, precision: str, slots: int, *, max_rows: int, graphs: bool,
                          graph_frames: tuple[int, ...]) -> KokoroSlots:
        self.decoder_model(precision)  # an unsupported precision fails here, before serving
        return KokoroSlots(self, precision, slots)

    def streaming_lag(self) -> int:
        return KokoroSlots.lag

    def guard_async(self, device_audio: Any) -> PendingAudio:
        from service.models.device_audio import guard_async

        return guard_async(device_audio)

    tokens = None  # no autoregressive stage
