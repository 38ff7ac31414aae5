"""The one small interface every inference backend implements.

Arrays cross the boundary as numpy (float32/int64) so the host-side glue (noise,
durations, chunking) is shared by all backends and results are comparable."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from service.models.family import Capabilities, HostAudio

__all__ = ["Backend", "Capabilities", "DevicePriorOut", "EncodeOut", "HostAudio", "VocodeOut"]


@dataclass
class EncodeOut:
    m_p: np.ndarray  # [B, C, T_ph] prior mean per phoneme
    logs_p: np.ndarray  # [B, C, T_ph] prior log-scale per phoneme
    logw: np.ndarray  # [B, 1, T_ph] log-durations (masked)


@dataclass
class DevicePriorOut:
    """The acoustic stage's output where the prior stays on the device (`encode_prior`): only the
    durations come to the host; the decoder reads the prior from where it was made."""

    logw: np.ndarray  # [B, 1, T_ph] log-durations (masked)
    prior: Any  # [B, 2, C, T_ph] (mean, noise scale x sigma) per phoneme, a tensor on the backend's device


@dataclass
class VocodeOut:
    audio: np.ndarray  # [B, S] float32; non-finite samples already zeroed
    nonfinite: np.ndarray  # [B] count of non-finite samples the guard saw per row
    precision: str  # "fp32" | "fp16": what actually produced this audio


class Backend(Protocol):
    """Runs the three stages of a VITS voice (a VITS family backend). One instance is owned by one thread
    (the engine loop); implementations need not be thread safe."""

    name: str
    device: str
    capabilities: Capabilities
    fp32_pins: tuple[str, ...]  # modules kept in FP32 when running FP16 (empty: no FP16)

    def encode(
        self, ids: np.ndarray, lengths: np.ndarray, dp_noise: np.ndarray, sid: np.ndarray | None
    ) -> EncodeOut: ...

    def flow(self, z_p: np.ndarray, sid: np.ndarray | None, precision: str = "fp32") -> np.ndarray:
        """Prior sample window [B, C, W] -> latent window [B, C, W]."""
        ...

    def vocode(self, z: np.ndarray, sid: np.ndarray | None, precision: str = "fp32") -> VocodeOut:
        """Latent window [B, C, W] -> guarded audio [B, W * hop]."""
        ...

    def supported_precisions(self) -> tuple[str, ...]: ...

    # What a backend has only where its `capabilities` say so (the runtime reads the flags first).

    def decoder_stages(self) -> list[tuple[int, int, int]]:
        """staged_decoder: (upsampling factor, input context, output channels) per stage."""
        ...

    def decode_stage(self, index: int, x: np.ndarray, sid: np.ndarray | None, precision: str = "fp32") -> np.ndarray:
        """staged_decoder: one flow coupling or generator stage in FP32 (or INT8 where supported)."""
        ...

    def streaming_decoder(self, precision: str, capacity: int, max_rows: int = 256, graphs: bool = True,
                          graph_frames: Sequence[int] = ()) -> Any:
        """slot_decoder: a `service.models.family.StreamingDecoder`."""
        ...

    def streaming_lag(self) -> int:
        """slot_decoder: frames its audio trails its input."""
        ...

    def guard_async(self, audio: Any) -> Any:
        """slot_decoder: the guard and the copy to the host queued behind a step (`.result()`: HostAudio)."""
        ...

    def encode_prior(self, ids: np.ndarray, lengths: np.ndarray, dp_noise: np.ndarray, sid: np.ndarray | None,
                     noise_scale: np.ndarray) -> DevicePriorOut:
        """priors_on_device: `encode` with the prior left on the device."""
        ...

    def encode_prior_async(self, ids: np.ndarray, lengths: np.ndarray, dp_noise: np.ndarray,
                           sid: np.ndarray | None, noise_scale: np.ndarray) -> Any:
        """priors_on_device: `encode_prior` queued (`.result()`: DevicePriorOut)."""
        ...

    def acoustic_split(self, lengths: Sequence[int]) -> list[int]:
        """acoustic_split: group sizes for an acoustic batch of ascending lengths."""
        ...

    def capture_encoder(self, max_batch: int) -> None:
        """encoder_graphs: capture the acoustic stage before serving."""
        ...
