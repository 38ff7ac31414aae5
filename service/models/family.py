"""What a model family gives the engine.

The engine never reaches into a network: it runs a family's acoustic stage through the
backend (`Backend.encode` + the synthesizer's host-side glue) and decodes audio through a
`StreamingDecoder`, which advances many sessions by the same number of latent frames in one
call while each session's decoder state stays in a slot on the device. A second family (an
iSTFT vocoder, say) plugs in by giving these two pieces and its FP32 pins."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class PriorRows:
    """A step's input frames, as the decoder draws them on its device: mean + sigma * noise,
    where noise is `service.models.noise.counter_normal(keys, starts)`. Rows past their
    utterance's end have mean = sigma = 0 (a family without noise passes sigma = 0)."""

    packed: np.ndarray  # [2, B, C, frames] float32: mean, sigma (one array: one upload)
    keys: Sequence[int]  # each row's noise key (its utterance's)
    starts: Sequence[int]  # each row's first frame, counted from its utterance's start

    @property
    def mean(self) -> np.ndarray:
        return self.packed[0]

    @property
    def sigma(self) -> np.ndarray:
        return self.packed[1]

    @property
    def shape(self) -> tuple[int, int, int]:
        _, b, c, f = self.packed.shape
        return int(b), int(c), int(f)


@dataclass(frozen=True)
class StepRows:
    """One batched decoder step: every row advances its slot by `frames` latent frames.

    `fed[i]` is how many latent frames row i's utterance had already been fed; `lengths[i]`
    its total frames; `inputs` the next frames of each row (zero past the end)."""

    slots: Sequence[int]
    inputs: PriorRows
    fed: Sequence[int]
    lengths: Sequence[int]
    sids: Sequence[int] | None


class StreamingDecoder(Protocol):
    """Prior frames -> audio, streamed, for many sessions at once (one precision)."""

    precision: str
    hop: int  # audio samples per latent frame
    lag: int  # latent frames the audio trails the input (the stages' right context)
    capacity: int  # slots
    step_seconds: dict[tuple[int, int], float]  # (rows, frames) -> measured time of one step (may be empty)

    def reset(self, slots: Sequence[int]) -> None:
        """Clear the state of `slots` before a new utterance starts in them."""
        ...

    def capture_all(self) -> None:
        """Prepare every step shape now (CUDA graphs), so no session pays for it later."""
        ...

    def step(self, rows: StepRows) -> Any:
        """Advance every row by `rows.inputs.shape[2]` frames. Returns the audio
        [B, frames x hop] covering positions (fed - lag) x hop onwards, on the device
        (a torch tensor for the torch backend); positions outside the utterance are 0."""
        ...
