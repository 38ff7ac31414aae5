"""Streaming vocoder that keeps each generator stage's output.

The windowed decoder recomputes the whole network's receptive field (12 latent
frames on each side for Piper's medium voices) for every chunk. Here each stage
(conv_pre, then one per upsampling layer) is run on a window of its own input with
just its own context and its new outputs are kept, so a chunk only recomputes a few
samples per stage. Every stage output equals the full decode's (each window carries
that stage's whole receptive field, or reaches the utterance edge where the full
decode pads with zeros too)."""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np


class StagedBackend(Protocol):
    def vocoder_stages(self) -> list[tuple[int, int, int]]:
        """(upsampling factor, input context, output channels) per stage."""
        ...

    def vocode_stage(self, index: int, x: np.ndarray, sid: np.ndarray | None) -> np.ndarray: ...


class StagedVocoder:
    """Audio for one utterance, chunk by chunk, from latent frames that arrive in order."""

    def __init__(self, backend: StagedBackend, frames: int, sid: np.ndarray | None) -> None:
        self.backend = backend
        self.sid = sid
        self.stages = backend.vocoder_stages()
        self.lengths = [frames]
        for factor, _, _ in self.stages:
            self.lengths.append(self.lengths[-1] * factor)
        # Buffers for every stage but the last (its output is handed out, not kept).
        self.buffers: list[np.ndarray] = [
            np.zeros((channels, self.lengths[i + 1]), dtype=np.float32)
            for i, (_, _, channels) in enumerate(self.stages[:-1])
        ]
        self.done = [0] * len(self.stages)

    def latent_needed(self, audio_end: int) -> int:
        """Latent frames that must be available to produce audio samples [.., audio_end)."""
        target = audio_end
        for s in reversed(range(len(self.stages))):
            factor, context, _ = self.stages[s]
            target = min(self.lengths[s], math.ceil(target / factor) + context)
        return target

    @staticmethod
    def lookahead(stages: list[tuple[int, int, int]]) -> int:
        """Latent frames needed beyond a chunk's end (away from the utterance's end)."""
        hop = math.prod(f for f, _, _ in stages)
        frames = 1 << 20
        target = frames * hop
        for factor, context, _ in reversed(stages):
            target = math.ceil(target / factor) + context
        return target - frames

    def audio(self, z: np.ndarray, available: int, start: int, end: int) -> np.ndarray:
        """Audio samples [start, end) (start = what was produced so far); z[:, :available]
        holds final latent frames, at least latent_needed(end) of them."""
        if start != self.done[-1]:
            raise ValueError(f"audio is produced in order: asked from {start}, made up to {self.done[-1]}")
        if self.latent_needed(end) > available:
            raise ValueError(f"audio up to {end} needs {self.latent_needed(end)} latent frames, {available} ready")
        return self._run(len(self.stages) - 1, end, z)[0]

    def _input(self, s: int, z: np.ndarray) -> np.ndarray:
        return z if s == 0 else self.buffers[s - 1]

    def _run(self, s: int, target: int, z: np.ndarray) -> np.ndarray:
        factor, context, _ = self.stages[s]
        lo_out, hi_out = self.done[s], target
        in_len = self.lengths[s]
        in_lo = max(0, lo_out // factor - context)
        in_hi = min(in_len, math.ceil(hi_out / factor) + context)
        if s > 0:
            self._ensure(s - 1, in_hi, z)
        x = self._input(s, z)[:, in_lo:in_hi]
        sid = self.sid if s == 0 else None
        y = self.backend.vocode_stage(s, x[None], sid)[0]
        out = y[:, lo_out - in_lo * factor : hi_out - in_lo * factor]
        self.done[s] = hi_out
        return out

    def _ensure(self, s: int, target: int, z: np.ndarray) -> None:
        if self.done[s] >= target:
            return
        lo = self.done[s]
        self.buffers[s][:, lo:target] = self._run(s, target, z)
