"""VITS streaming decoder with per-session state in device slots (continuous batching).

The flow couplings and generator stages run as a pipeline. Stage s keeps, per slot, the
last `lead_s + context_s` frames of its input; a step appends `frames x rate_s` new input
frames to that history and keeps the outputs `lead_s` frames behind the input's end, so
each stage always has its full right context. Every stage's lead is a whole number of
latent frames, so the audio trails the prior input by a fixed `lag` of latent frames and
every step has the same shapes whatever the rows' positions: rows of any sessions share a
call, and each (batch, frames) shape can be captured once as a CUDA graph.

Positions outside the utterance are masked to zero inside every stage (the zero padding a
full decode sees at its edges), so the audio equals the full decode's exactly, including
the first and last samples. Frames past the end are fed as zeros until the audio catches up.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from service.models.cuda_graphs import GraphCapturer
from service.models.family import StepRows
from service.models.noise import counter_normal
from service.models.vits.model import VitsModel
from service.models.vits.receptive_field import decoder_stage_table


@dataclass(frozen=True)
class StageShape:
    """One pipeline stage: upsampling `factor`, input `rate` (input frames per latent
    frame), input `channels`, `context` (input frames needed on each side) and `lead`
    (input frames the output trails the input by: context rounded up to whole latent frames)."""

    factor: int
    rate: int
    channels: int
    context: int
    lead: int

    @property
    def history(self) -> int:
        return self.lead + self.context


def stage_shapes(model: VitsModel) -> list[StageShape]:
    table = decoder_stage_table(model)
    out, rate, channels = [], 1, model.hp.inter_channels
    for factor, context, out_channels in table:
        lead = math.ceil(context / rate) * rate
        out.append(StageShape(factor, rate, channels, context, lead))
        rate *= factor
        channels = out_channels
    if model.dec.stage_lengths(7)[-1] != 7 * rate:
        raise ValueError("the generator's upsamplers do not multiply lengths exactly; streaming needs they do")
    return out


class VitsStreamingDecoder:
    """Implements service.models.family.StreamingDecoder for one model copy (one precision).

    `graphs`: capture each (batch bucket, frames) step, for frames in `graph_frames`, as a
    CUDA graph on first use; a batch is padded up to its bucket with rows of a scratch slot."""

    def __init__(
        self, model: VitsModel, precision: str, capacity: int, device: torch.device, dtype: torch.dtype,
        graphs: bool = False, graph_frames: Sequence[int] = (),
        buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    ) -> None:
        self.model = model
        self.precision = precision
        self.capacity = capacity
        self.device = device
        self.dtype = dtype
        self.shapes = stage_shapes(model)
        self.hop = math.prod(s.factor for s in self.shapes)
        self.lag = sum(s.lead // s.rate for s in self.shapes)
        self._lag_before = [sum(s.lead // s.rate for s in self.shapes[:i]) for i in range(len(self.shapes))]
        self._scratch = capacity  # padding rows of a bucket read and write this extra slot
        self.history = [
            torch.zeros(capacity + 1, s.channels, s.history, dtype=dtype, device=device) for s in self.shapes
        ]
        self.multi_speaker = model.emb_g is not None
        self.graphs = graphs and device.type == "cuda"
        self.graph_frames = frozenset(graph_frames)  # other step sizes (FP32 redo replays) run eagerly
        self.buckets = tuple(sorted(b for b in buckets if b <= capacity)) or (capacity,)
        self._captured: dict[tuple[int, int], _CapturedStep] = {}
        self.step_seconds: dict[tuple[int, int], float] = {}  # (rows, frames) -> one step, measured
        self._capturer = GraphCapturer(device)

    # --- state ---------------------------------------------------------------------------------

    def reset(self, slots: Sequence[int]) -> None:
        if not slots:
            return
        index = self._upload(np.asarray(list(slots), dtype=np.int64))
        for h in self.history:
            h.index_fill_(0, index, 0)

    # --- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, rows: StepRows) -> torch.Tensor:
        b, _, frames = rows.inputs.shape
        if self.graphs and frames in self.graph_frames:
            bucket = next((x for x in self.buckets if x >= b), None)
            if bucket is not None:
                return self._graph_step(rows, bucket)[:b]
        return self._run(*self._tensors(rows, b))

    def _upload(self, values: np.ndarray) -> torch.Tensor:
        """Host -> device without waiting for the device: through pinned memory on CUDA (a
        pageable copy would wait for the step still running, and the pipeline with it)."""
        return _pinned(values, self.device).to(self.device, non_blocking=True)

    def _tensors(self, rows: StepRows, b: int) -> tuple[torch.Tensor, ...]:
        ints = self._upload(_int_rows(rows, b))
        return self._inputs(ints, self._upload(rows.inputs.packed))

    def _inputs(self, ints: torch.Tensor, parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(slots, z, fed, lengths, sids) from the packed step inputs: the prior sample is drawn
        here, on the device (inside the CUDA graph when the step is captured)."""
        slots, fed, lengths, sids, keys, starts = ints
        _, _, channels, frames = parts.shape
        z = (parts[0] + parts[1] * counter_normal(keys, starts, channels, frames)).to(self.dtype)
        return slots, z, fed, lengths, sids

    def _run(
        self, slots: torch.Tensor, z: torch.Tensor, fed: torch.Tensor, lengths: torch.Tensor, sids: torch.Tensor
    ) -> torch.Tensor:
        """The step as plain tensor ops (what a CUDA graph captures)."""
        model = self.model
        g = model.speaker_embedding(sids) if self.multi_speaker else None
        frames = z.shape[2]
        x_new = z
        for s, shape in enumerate(self.shapes):
            hist = self.history[s]
            x = torch.cat([hist.index_select(0, slots), x_new], dim=2)
            hist.index_copy_(0, slots, x[:, :, x.shape[2] - shape.history :])
            # Absolute position (at this stage's output rate) of the window's first output.
            start_in = (fed - self._lag_before[s]) * shape.rate - shape.history
            out_len = x.shape[2] * shape.factor
            positions = (start_in * shape.factor).unsqueeze(1) + torch.arange(out_len, device=x.device)
            valid = (positions >= 0) & (positions < (lengths * shape.rate * shape.factor).unsqueeze(1))
            mask = valid.unsqueeze(1).to(x.dtype)
            y = model.decoder_stage(s, x, g if model.uses_speaker(s) else None, mask)
            keep = shape.context * shape.factor
            x_new = y[:, :, keep : keep + frames * shape.rate * shape.factor]
        return x_new.squeeze(1)

    # --- CUDA graphs ---------------------------------------------------------------------------

    def capture_all(self) -> None:
        """Capture every (bucket, frames) graph now, so no session waits for a capture later,
        and time each one (`step_seconds`: the capacity estimate starts from these)."""
        if not self.graphs:
            return
        with torch.inference_mode():
            for frames in sorted(self.graph_frames):
                for bucket in self.buckets:
                    if (bucket, frames) not in self._captured:
                        self._captured[(bucket, frames)] = self._capture(bucket, frames)
                    graph = self._captured[(bucket, frames)].graph
                    torch.cuda.synchronize(self.device)
                    best = float("inf")
                    for _ in range(3):
                        t0 = time.perf_counter()
                        graph.replay()
                        torch.cuda.synchronize(self.device)
                        best = min(best, time.perf_counter() - t0)
                    self.step_seconds[(bucket, frames)] = best

    def _graph_step(self, rows: StepRows, bucket: int) -> torch.Tensor:
        """Two uploads and one replay: every other op of the step (the noise draw included) is
        inside the graph, so the engine thread makes few calls per step (each one may wait for
        the GIL while the event loop is busy)."""
        frames = rows.inputs.shape[2]
        captured = self._captured.get((bucket, frames))
        if captured is None:
            captured = self._capture(bucket, frames)
            self._captured[(bucket, frames)] = captured
        b = rows.inputs.shape[0]
        ints = _int_rows(rows, b, bucket, self._scratch)
        captured.ints.copy_(_pinned(ints, self.device), non_blocking=True)
        if b < bucket:
            captured.parts[:, b:].zero_()  # padding rows: mean = sigma = 0
        captured.parts[:, :b].copy_(_pinned(rows.inputs.packed, self.device), non_blocking=True)
        captured.graph.replay()
        return captured.out

    def _capture(self, bucket: int, frames: int) -> _CapturedStep:
        dev = self.device
        channels = self.shapes[0].channels
        ints = torch.zeros(6, bucket, dtype=torch.long, device=dev)
        ints[0].fill_(self._scratch)
        parts = torch.zeros(2, bucket, channels, frames, dtype=torch.float32, device=dev)
        graph, out = self._capturer.capture(lambda i, p: self._run(*self._inputs(i, p)), ints, parts)
        # Warm-up and capture wrote into the scratch slot only; it holds no session.
        return _CapturedStep(graph, ints, parts, out)


def _int_rows(rows: StepRows, b: int, bucket: int | None = None, scratch: int = 0) -> np.ndarray:
    """[6, bucket] int64: slots, fed, lengths, speaker ids, noise keys, first frames; rows past
    `b` read and write the scratch slot with length 0."""
    prior = rows.inputs
    out = np.zeros((6, bucket or b), dtype=np.int64)
    out[0, b:] = scratch
    out[:, :b] = [rows.slots, rows.fed, rows.lengths, rows.sids if rows.sids is not None else [0] * b,
                  prior.keys, prior.starts]
    return out


def _pinned(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host tensor a non-blocking copy to `device` can read without waiting (pinned on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(values))
    return t.pin_memory() if device.type == "cuda" else t


@dataclass
class _CapturedStep:
    graph: torch.cuda.CUDAGraph
    ints: torch.Tensor  # [6, bucket]: see _int_rows
    parts: torch.Tensor  # [2, bucket, C, frames]: mean, sigma
    out: torch.Tensor
