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


class Prior(Protocol):
    """An utterance's prior as a decoder draws it: frame t is mean[:, src[t]] + sigma[:, src[t]]
    x noise, where noise is `service.models.noise.counter_normal(key, t)` (a family without
    noise has sigma = 0)."""

    key: int
    src: np.ndarray  # [T] phoneme id of each latent frame
    # A family whose acoustic stage runs on the decoder's device may give mean and sigma there
    # instead, as one [2, C, P] tensor (the decoder then copies them on the device); else None.
    device_values: Any

    @property
    def mean(self) -> np.ndarray:
        """[C, P] per phoneme id."""
        ...

    @property
    def sigma(self) -> np.ndarray:
        """[C, P] noise scale per phoneme id."""
        ...

    @property
    def frames(self) -> int: ...

    @property
    def phonemes(self) -> int:
        """Columns of mean and sigma."""
        ...


@dataclass(frozen=True)
class StepRows:
    """One batched decoder step: every row advances its slot by `frames` latent frames, the
    next frames of the prior its slot was started with (zero past the utterance's end).

    `fed[i]` is how many latent frames row i's utterance had already been fed."""

    slots: Sequence[int]
    fed: Sequence[int]
    frames: int
    sids: Sequence[int] | None


class StreamingDecoder(Protocol):
    """Prior frames -> audio, streamed, for many sessions at once (one precision)."""

    precision: str
    hop: int  # audio samples per latent frame
    lag: int  # latent frames the audio trails the input (the stages' right context)
    capacity: int  # slots
    step_seconds: dict[tuple[int, int], float]  # (rows, frames) -> measured time of one step (may be empty)

    def start(self, slot: int, prior: Prior) -> bool:
        """Begin `prior`'s utterance in `slot`: clear the slot's state and keep the prior on the
        device (a step then uploads only which of its columns each frame reads). False when the
        decoder's prior memory is full: the slot then holds no prior; try again when an
        utterance is freed. ValueError for a prior longer than that memory can ever hold."""
        ...

    def free(self, slot: int) -> None:
        """The slot's utterance is over: give back its prior memory."""
        ...

    def capture_all(self) -> None:
        """Prepare every step shape now (CUDA graphs), so no session pays for it later."""
        ...

    def step(self, rows: StepRows) -> Any:
        """Advance every row by `rows.frames` frames. Returns the audio
        [B, frames x hop] covering positions (fed - lag) x hop onwards, on the device
        (a torch tensor for the torch backend); positions outside the utterance are 0."""
        ...


class UtteranceDecoder(Protocol):
    """One utterance decoded alone, chunk by chunk, in order (the staged decoding of a CPU
    backend: each stage's output kept between chunks)."""

    def audio(self, start: int, end: int) -> np.ndarray:
        """Audio samples [start, end), float32; `start` is where the previous chunk ended."""
        ...
