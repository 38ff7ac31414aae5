"""Streaming decoder that keeps every stage's output between chunks.

A windowed decoder recomputes the whole network's receptive field for every
chunk (32 latent frames through the flow and 12 through the generator on each
side, for Piper's medium voices). Here the flow runs one stage per coupling and
the generator one stage per upsampling layer; each stage is run on a window of
its own input with just its own context, and its new outputs are kept, so a
chunk only recomputes a few frames or samples per stage. Every stage output
equals the full decode's (each window carries that stage's whole receptive
field, or reaches the utterance edge where the full decode pads with zeros too)."""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np


class StagedBackend(Protocol):
    def decoder_stages(self) -> list[tuple[int, int, int]]:
        """(upsampling factor, input context, output channels) per stage: the flow's
        couplings, then the generator's stages."""
        ...

    def decode_stage(
        self, index: int, x: np.ndarray, sid: np.ndarray | None, precision: str = "fp32",
    ) -> np.ndarray: ...


class StagedDecoder:
    """Audio for one utterance, chunk by chunk, from its whole prior sample z_p."""

    def __init__(
        self, backend: StagedBackend, z_p: np.ndarray, sid: np.ndarray | None,
        flow_piece_frames: int = 0, precision: str = "fp32",
    ) -> None:
        self.backend = backend
        self.precision = precision
        self.sid = sid
        self.z_p = z_p
        self.stages = backend.decoder_stages()
        # After their first call (which the time to first audio waits for, so it runs only what
        # the first chunk needs), the frame-rate stages (the flow's couplings, conv_pre) run
        # ahead in pieces of at least `flow_piece_frames`: small calls cost more per frame.
        self.frame_rate_stages = next((i for i, (f, _, _) in enumerate(self.stages) if f > 1), len(self.stages))
        self.flow_piece = flow_piece_frames
        self.lengths = [int(z_p.shape[1])]
        for factor, _, _ in self.stages:
            self.lengths.append(self.lengths[-1] * factor)
        # Buffers for every stage but the last (its output is handed out, not kept).
        self.buffers: list[np.ndarray] = [
            np.zeros((channels, self.lengths[i + 1]), dtype=np.float32)
            for i, (_, _, channels) in enumerate(self.stages[:-1])
        ]
        self.done = [0] * len(self.stages)

    @property
    def samples(self) -> int:
        return self.lengths[-1]

    def audio(self, start: int, end: int) -> np.ndarray:
        """Audio samples [start, end); start is what was produced so far."""
        if start != self.done[-1]:
            raise ValueError(f"audio is produced in order: asked from {start}, made up to {self.done[-1]}")
        if not 0 <= start <= end <= self.samples:
            raise ValueError(f"audio span [{start}, {end}) is outside the utterance's {self.samples} samples")
        return self._run(len(self.stages) - 1, end)[0]

    def _input(self, s: int) -> np.ndarray:
        return self.z_p if s == 0 else self.buffers[s - 1]

    def _run(self, s: int, target: int) -> np.ndarray:
        factor, context, _ = self.stages[s]
        lo_out, hi_out = self.done[s], target
        in_len = self.lengths[s]
        in_lo = max(0, lo_out // factor - context)
        in_hi = min(in_len, math.ceil(hi_out / factor) + context)
        if s > 0:
            self._ensure(s - 1, in_hi)
        x = self._input(s)[:, in_lo:in_hi]
        y = self.backend.decode_stage(s, x[None], self.sid, self.precision)[0]
        out = y[:, lo_out - in_lo * factor : hi_out - in_lo * factor]
        self.done[s] = hi_out
        return out

    def _ensure(self, s: int, target: int) -> None:
        if self.done[s] >= target:
            return
        lo = self.done[s]
        if s < self.frame_rate_stages:
            if lo:
                target = min(self.lengths[s + 1], max(target, lo + self.flow_piece))
        self.buffers[s][:, lo:target] = self._run(s, target)
