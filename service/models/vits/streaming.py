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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from service.models.cuda_graphs import GraphCapturer
from service.models.family import Prior, StepRows
from service.models.noise import counter_normal
from service.models.transfer import pinned, to_device
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


class PriorMemory:
    """The prior (per phoneme mean and sigma) of every utterance a decoder has started, on the
    device, in blocks of columns, the way vLLM pages its KV cache: an utterance takes whatever
    blocks are free, and a step uploads only which column each of its frames reads (the host
    used to upload every row's frames of mean and sigma, the step's largest cost).

    `table` is [2, C, columns + 1] float32 (mean, sigma); its last column stays zero and is what
    frames past an utterance's end (and padding rows) read. New priors are staged on the host
    and written by `flush`, before the next step, in one upload."""

    BLOCK = 32  # columns per block

    def __init__(self, columns: int, channels: int, slots: int, device: torch.device) -> None:
        blocks = max(1, math.ceil(columns / self.BLOCK))
        self.zero = blocks * self.BLOCK
        self.table = torch.zeros(2, channels, self.zero + 1, dtype=torch.float32, device=device)
        self._free = list(range(blocks - 1, -1, -1))
        self._blocks: dict[int, list[int]] = {}  # slot -> the blocks its prior occupies
        self._frame_columns: dict[int, np.ndarray] = {}  # slot -> the column each frame reads
        self.keys = np.zeros(slots, dtype=np.int64)
        self.lengths = np.zeros(slots, dtype=np.int64)  # frames; 0 for a free slot
        self._staged: dict[int, tuple[np.ndarray, Prior]] = {}  # slot -> (columns, prior) to write

    def put(self, slot: int, prior: Prior) -> bool:
        self.drop(slot)
        phonemes = prior.phonemes
        need = math.ceil(phonemes / self.BLOCK)
        if need > self.zero // self.BLOCK:
            raise ValueError(
                f"an utterance of {phonemes} phoneme ids is longer than the decoder's prior memory "
                f"({self.zero} columns) can hold; send shorter sentences"
            )
        if need > len(self._free):
            return False
        blocks = [self._free.pop() for _ in range(need)]
        j = np.arange(phonemes)
        columns = np.asarray(blocks, dtype=np.int64)[j // self.BLOCK] * self.BLOCK + j % self.BLOCK
        self._staged[slot] = (columns, prior)
        self._blocks[slot] = blocks
        self._frame_columns[slot] = columns[prior.src]
        self.keys[slot] = prior.key
        self.lengths[slot] = prior.frames
        return True

    def drop(self, slot: int) -> None:
        self._free += self._blocks.pop(slot, [])
        self._staged.pop(slot, None)  # its blocks may go to another slot before the next flush
        self._frame_columns.pop(slot, None)
        self.lengths[slot] = 0

    def flush(self, upload: Callable[[np.ndarray], torch.Tensor]) -> list[int]:
        """Write the staged priors into `table` (queued on the current stream, ahead of the
        step that reads them); returns their slots. Priors made on the device are copied there;
        host ones go up in one upload."""
        if not self._staged:
            return []
        slots, staged = list(self._staged), list(self._staged.values())
        self._staged.clear()
        on_device = [(c, p) for c, p in staged if getattr(p, "device_values", None) is not None]
        on_host = [(c, p) for c, p in staged if getattr(p, "device_values", None) is None]
        if on_device:
            columns = np.concatenate([c for c, _ in on_device])
            values = torch.cat([p.device_values for _, p in on_device], dim=2)
            if values.device.type == "cuda":  # made on the acoustic stage's stream, read on this one
                # Once per allocation, not per prior: the priors of one acoustic call are views of
                # one tensor, and each call gives the GIL up and may wait to get it back.
                shared = {p.device_values.untyped_storage().data_ptr(): p.device_values for _, p in on_device}
                for view in shared.values():
                    view.record_stream(torch.cuda.current_stream(values.device))
            self.table.index_copy_(2, upload(columns), values.to(self.table.device, torch.float32))
        if on_host:
            columns = np.concatenate([c for c, _ in on_host])
            host = np.empty((2, self.table.shape[1], len(columns)), dtype=np.float32)
            at = 0
            for c, prior in on_host:
                host[0, :, at : at + len(c)] = prior.mean
                host[1, :, at : at + len(c)] = prior.sigma
                at += len(c)
            self.table.index_copy_(2, upload(columns), upload(host))
        return slots

    def columns(self, slots: Sequence[int], fed: Sequence[int], frames: int, out: np.ndarray) -> None:
        """Fill `out` [frames, rows] with the column each row's next `frames` frames read (the
        zero column past the end, and for rows past `slots`)."""
        out.fill(self.zero)
        for i, (slot, lo) in enumerate(zip(slots, fed, strict=True)):
            cols = self._frame_columns[slot][lo : lo + frames]
            out[: len(cols), i] = cols


class VitsStreamingDecoder:
    """Implements service.models.family.StreamingDecoder for one model copy (one precision).

    `graphs`: capture each (batch bucket, frames) step, for frames in `graph_frames`, as a
    CUDA graph on first use; a batch is padded up to its bucket with rows of a scratch slot.
    `prior_columns`: the prior memory shared by the slots, in phoneme ids (default: an average
    of `PRIOR_COLUMNS_PER_SLOT` per slot)."""

    PRIOR_COLUMNS_PER_SLOT = 256

    def __init__(
        self, model: VitsModel, precision: str, capacity: int, device: torch.device, dtype: torch.dtype,
        graphs: bool = False, graph_frames: Sequence[int] = (),
        buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512), prior_columns: int | None = None,
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
        columns = prior_columns or max(capacity * self.PRIOR_COLUMNS_PER_SLOT, 4096)
        self.prior = PriorMemory(columns, self.shapes[0].channels, capacity + 1, device)

    # --- state ---------------------------------------------------------------------------------

    def start(self, slot: int, prior: Prior) -> bool:
        return self.prior.put(slot, prior)  # the slot's state is cleared with the prior's write

    def free(self, slot: int) -> None:
        self.prior.drop(slot)

    def _flush(self) -> None:
        """Queue what `start` staged (new priors, their slots' state cleared) ahead of the next step."""
        started = self.prior.flush(self._upload)
        if started:
            index = self._upload(np.asarray(started, dtype=np.int64))
            for h in self.history:
                h.index_fill_(0, index, 0)

    # --- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, rows: StepRows) -> torch.Tensor:
        self._flush()
        b = len(rows.slots)
        if self.graphs and rows.frames in self.graph_frames:
            bucket = next((x for x in self.buckets if x >= b), None)
            if bucket is not None:
                return self._graph_step(rows, bucket)[:b]
        return self._run(*self._inputs(self._upload(self._int_rows(rows, b))))

    def _upload(self, values: np.ndarray) -> torch.Tensor:
        """Host -> device without waiting for the device: through pinned memory on CUDA (a
        pageable copy would wait for the step still running, and the pipeline with it)."""
        return to_device(values, self.device)

    def _int_rows(self, rows: StepRows, bucket: int) -> np.ndarray:
        """A step's whole input, [5 + frames, bucket] int64: slots, fed, lengths, speaker ids,
        noise keys, then the prior column each frame reads. Rows past the step's read and write
        the scratch slot with length 0."""
        b = len(rows.slots)
        out = np.zeros((5 + rows.frames, bucket), dtype=np.int64)
        slots = np.asarray(rows.slots, dtype=np.int64)
        out[0, :b] = slots
        out[0, b:] = self._scratch
        out[1, :b] = rows.fed
        out[2, :b] = self.prior.lengths[slots]
        if rows.sids is not None:
            out[3, :b] = rows.sids
        out[4, :b] = self.prior.keys[slots]
        self.prior.columns(rows.slots, rows.fed, rows.frames, out[5:])
        return out

    def _inputs(self, ints: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(slots, z, fed, lengths, sids) from a step's input (`_int_rows`): the prior sample is
        gathered and drawn here, on the device (inside the CUDA graph when the step is captured)."""
        slots, fed, lengths, sids, keys = ints[:5]
        columns = ints[5:]
        frames, bucket = columns.shape
        channels = self.prior.table.shape[1]
        parts = self.prior.table.index_select(2, columns.reshape(-1)).view(2, channels, frames, bucket)
        mean, sigma = parts.permute(0, 3, 1, 2)  # [bucket, C, frames] each
        z = (mean + sigma * counter_normal(keys, fed, channels, frames)).to(self.dtype)
        return slots, z, fed, lengths, sids

    def _run(
        self, slots: torch.Tensor, z: torch.Tensor, fed: torch.Tensor, lengths: torch.Tensor, sids: torch.Tensor
    ) -> torch.Tensor:
        """The step as plain tensor ops (what a CUDA graph captures): the rows' state gathered
        from their slots, `run_stages`, the new state scattered back."""
        model = self.model
        g = model.speaker_embedding(sids) if self.multi_speaker else None
        states = [hist.index_select(0, slots) for hist in self.history]
        audio, new_states = run_stages(model, self.shapes, self._lag_before, z, fed, lengths, g, states)
        for hist, state in zip(self.history, new_states, strict=True):
            hist.index_copy_(0, slots, state)
        return audio

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
        """One upload and one replay: every other op of the step (the prior gather and the noise
        draw included) is inside the graph, so the engine thread makes few calls per step (each
        one may wait for the GIL while other threads are busy)."""
        captured = self._captured.get((bucket, rows.frames))
        if captured is None:
            captured = self._capture(bucket, rows.frames)
            self._captured[(bucket, rows.frames)] = captured
        captured.ints.copy_(pinned(self._int_rows(rows, bucket), self.device), non_blocking=True)
        captured.graph.replay()
        return captured.out

    def _capture(self, bucket: int, frames: int) -> _CapturedStep:
        ints = torch.zeros(5 + frames, bucket, dtype=torch.long, device=self.device)
        ints[0].fill_(self._scratch)
        ints[5:].fill_(self.prior.zero)
        graph, out = self._capturer.capture(lambda i: self._run(*self._inputs(i)), ints)
        # Warm-up and capture wrote into the scratch slot only; it holds no session.
        return _CapturedStep(graph, ints, out)


@dataclass
class _CapturedStep:
    graph: torch.cuda.CUDAGraph
    ints: torch.Tensor  # [5 + frames, bucket]: see _int_rows
    out: torch.Tensor


def run_stages(
    model: VitsModel, shapes: Sequence[StageShape], lag_before: Sequence[int], z: torch.Tensor, fed: torch.Tensor,
    lengths: torch.Tensor, g: torch.Tensor | None, states: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One decoder step over explicit state, the one copy of its arithmetic (the slot decoder
    and the exported step graph both run it): prior frames z [B, C, F] through every stage, each
    stage's input joined to its history `states[s]`, masked outside the utterance. Returns the
    audio [B, F x hop] and each stage's next history."""
    frames = z.shape[2]
    x_new = z
    new_states = []
    for s, shape in enumerate(shapes):
        x = torch.cat([states[s], x_new], dim=2)
        new_states.append(x[:, :, x.shape[2] - shape.history :])
        # Absolute position (at this stage's output rate) of the window's first output.
        start_in = (fed - lag_before[s]) * shape.rate - shape.history
        out_len = x.shape[2] * shape.factor
        positions = (start_in * shape.factor).unsqueeze(1) + torch.arange(out_len, device=x.device)
        valid = (positions >= 0) & (positions < (lengths * shape.rate * shape.factor).unsqueeze(1))
        mask = valid.unsqueeze(1).to(x.dtype)
        y = model.decoder_stage(s, x, g if model.uses_speaker(s) else None, mask)
        keep = shape.context * shape.factor
        x_new = y[:, :, keep : keep + frames * shape.rate * shape.factor]
    return x_new.squeeze(1), new_states
