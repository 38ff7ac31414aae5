"""A Kokoro voice on the torch backend, as the engine drives it (`service.models.family.VoiceRuntime`).

The acoustic stage (PL-BERT, prosody predictor, text encoder) runs per sentence and gives the
decoder's per-frame input: 512 text features, two F0 and two energy values per 25 ms frame, held
as frame columns (`FrameColumns`, a `Prior` with no noise). The style vector is the voice pack's row
for the sentence's length, as the official pipeline picks it. The decoder (iSTFTNet with a sine
source) is not streamed yet: its AdaIN layers normalise over the whole utterance, so a chunk of it
is not a chunk of the full decode. The engine decodes each utterance whole at its first chunk
(`Capabilities.staged_decoder`, one stage) and hands the rest out as its chunks come due. The sine
source's noise is drawn from the utterance's own seeded key, so a seed gives the same audio."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
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
    StreamingDecoder,
    VoiceInfo,
)
from service.models.kokoro.model import KokoroModel
from service.models.kokoro.voices import VOICE_ROWS


class FrameColumns:
    """Per-frame decoder input as a `Prior`: column t is frame t (no noise)."""

    def __init__(self, values: np.ndarray, key: int) -> None:
        self.values = values  # [C, T]
        self.key = key
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
    prior: FrameColumns  # rows: text features, then F0 (2 per frame), then energy (2 per frame)
    style: torch.Tensor  # [256] the pack's row for this sentence's length
    durations: np.ndarray  # frames per token, the boundary tokens included
    word_spans: list[tuple[str, int, int]]
    sid: int | None = None
    audio: np.ndarray | None = field(default=None, repr=False)  # the whole decode, once made

    @property
    def frames(self) -> int:
        return self.prior.frames


class _Whole:
    """An utterance decoded whole on its first chunk; later chunks are slices of it."""

    def __init__(self, runtime: KokoroRuntime, utt: KokoroUtterance) -> None:
        self.runtime, self.utt = runtime, utt

    def audio(self, start: int, end: int) -> np.ndarray:
        if self.utt.audio is None:
            self.utt.audio = self.runtime.reference(self.utt)
        return self.utt.audio[start:end]


_MODELS: dict[tuple[str, str], KokoroModel] = {}
_MODELS_LOCK = threading.Lock()


def shared_model(model_path: Path, device: str) -> KokoroModel:
    """One model per file and device, whichever voices use it (a voice is only its style table)."""
    key = (str(model_path.resolve()), device)
    with _MODELS_LOCK:
        model = _MODELS.get(key)
        if model is None:
            from service.models.kokoro.weights import dequantised_state_dict

            model = KokoroModel()
            state = model.state_dict()
            state.update(dequantised_state_dict(model_path))  # ALBERT's unused pooler keeps its init
            model.load_state_dict(state, strict=True)
            model = _MODELS[key] = model.to(device).eval()
    return model


class KokoroRuntime:
    """A Kokoro voice (FP32, torch) for one engine thread."""

    backend_name = "torch"
    capabilities = Capabilities(staged_decoder=True)
    fp32_pins: tuple[str, ...] = ()
    pin_candidates: tuple[str, ...] = ()

    def __init__(self, info: VoiceInfo, device: str, schedule: ChunkSchedule | None = None) -> None:
        from service.models.kokoro.weights import load_voice_pack

        self.info = info
        self.device = torch.device(device)
        self.schedule = schedule or ChunkSchedule()
        self.model = shared_model(info.config_path, device)
        self.pack = load_voice_pack(info.model_path).to(self.device)  # [510, 1, 256]

    @property
    def sample_rate(self) -> int:
        return self.info.sample_rate

    @property
    def hop(self) -> int:
        return self.model.samples_per_frame

    def precisions(self) -> tuple[str, ...]:
        return ("fp32",)

    def prepare(self, max_batch: int) -> None:
        """Nothing is captured before serving."""

    @torch.inference_mode()
    def acoustic_batch(self, jobs: list[AcousticJob]) -> list[KokoroUtterance]:
        """One sentence at a time: each has its own frame count and style row."""
        return [self._acoustic(job) for job in jobs]

    def _acoustic(self, job: AcousticJob) -> KokoroUtterance:
        """The sentence's ids hold the boundary tokens already (the frontend adds them); the
        style row is picked by its phoneme count less one, as the official pipeline does."""
        ids = list(job.sentence.phoneme_ids)
        style = self.pack[min(max(len(job.sentence.phonemes) - 1, 0), VOICE_ROWS - 1), 0]
        length_scale = self.info.length_scale if job.params.length_scale is None else job.params.length_scale
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        out = self.model.acoustic(tokens, style[None], speed=1.0 / length_scale)
        frames = out.asr.shape[-1]
        values = torch.cat([out.asr[0], out.f0[0].view(frames, 2).T, out.n[0].view(frames, 2).T])
        durations = out.durations.cpu().numpy()
        ends = np.concatenate([[0], np.cumsum(durations)]) * self.hop  # token k starts at ends[k]
        words = [(w.text, int(ends[w.start_id]), int(ends[w.end_id])) for w in job.sentence.words]
        key = int(job.rng.integers(0, 1 << 63))
        return KokoroUtterance(job.sentence.text, ids, FrameColumns(values.float().cpu().numpy(), key), style,
                               durations, words)

    def utterance_decoder(self, utt: DecoderInput) -> _Whole:
        assert isinstance(utt, KokoroUtterance), "a Kokoro voice decodes its own acoustic stage's output"
        return _Whole(self, utt)

    @torch.inference_mode()
    def reference(self, utt: DecoderInput, precision: str = "fp32") -> np.ndarray:
        """The whole utterance decoded at once, its source noise from the utterance's key."""
        assert isinstance(utt, KokoroUtterance), "a Kokoro voice decodes its own acoustic stage's output"
        if precision != "fp32":
            raise ValueError(f"Kokoro runs in FP32 only for now, not {precision}")
        values = torch.from_numpy(utt.prior.values).to(self.device)
        hidden = values.shape[0] - 4
        asr = values[None, :hidden]
        f0, n = (values[row : row + 2].T.reshape(1, -1) for row in (hidden, hidden + 2))  # back to 2 per frame
        generator = torch.Generator().manual_seed(utt.prior.key)
        audio = self.model.decode(asr, f0, n, utt.style[None], generator=generator)
        return audio[0].float().cpu().numpy()

    # --- what Capabilities says Kokoro does not have (yet) --------------------------------------

    def streaming_decoder(self, precision: str, slots: int, *, max_rows: int, graphs: bool,
                          graph_frames: tuple[int, ...]) -> StreamingDecoder:
        raise ValueError("Kokoro voices have no slot decoder yet (Capabilities.slot_decoder is False)")

    def streaming_lag(self) -> int:
        raise ValueError("Kokoro voices have no slot decoder yet (Capabilities.slot_decoder is False)")

    def guard_async(self, device_audio: Any) -> PendingAudio:
        raise ValueError("Kokoro voices have no slot decoder yet (Capabilities.slot_decoder is False)")

    tokens = None  # no autoregressive stage
