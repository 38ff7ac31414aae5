"""The one small interface every inference backend implements.

Arrays cross the boundary as numpy (float32/int64) so the host-side glue (noise,
durations, chunking) is shared by all backends and results are comparable."""

from __future__ import annotations

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
