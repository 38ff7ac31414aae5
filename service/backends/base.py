"""The one small interface every inference backend implements.

Arrays cross the boundary as numpy (float32/int64) so the host-side glue (noise,
durations, chunking) is shared by all backends and results are comparable."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np


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
    peak: np.ndarray  # [B] max |x| over finite samples
    precision: str  # "fp32" | "fp16": what actually produced this audio


class HostAudio(NamedTuple):
    """A decoder step's guarded audio on the host."""

    audio: np.ndarray  # [B, S] float32; non-finite samples zeroed
    nonfinite: np.ndarray  # [B] int64, non-finite samples the guard saw per row
    pcm16: np.ndarray  # [B, S] int16, the same audio as 16-bit PCM (`float_to_int16`'s), made by the guard


def guard_host(audio: np.ndarray, precision: str) -> VocodeOut:
    """The guard for audio already on the host: count and zero non-finite samples, find the peak."""
    finite = np.isfinite(audio)
    nonfinite = (~finite).sum(axis=1)
    clean = np.where(finite, audio, np.float32(0.0)).astype(np.float32, copy=False)
    peak = np.abs(clean).max(axis=1) if clean.shape[1] else np.zeros(clean.shape[0], np.float32)
    return VocodeOut(audio=clean, nonfinite=nonfinite, peak=peak, precision=precision)


@dataclass(frozen=True)
class Capabilities:
    """What a backend offers beyond `Backend`'s stages, declared by the backend itself: the engine
    reads these flags and never probes a backend for methods."""

    slot_decoder: bool = False  # streaming_decoder(): batched fixed-shape steps over device slots
    staged_decoder: bool = False  # decoder_stages()/decode_stage(): each utterance decoded stage by stage
    asynchronous: bool = False  # a decoder step is queued on the device; the engine thread goes on meanwhile
    priors_on_device: bool = False  # encode_prior(_async)(): the acoustic stage's prior stays on the device
    acoustic_split: bool = False  # acoustic_split(): an acoustic batch cut by length into several calls
    encoder_graphs: bool = False  # capture_encoder(): the acoustic stage captured before serving


class Backend(Protocol):
    """Runs the three stages of a VITS voice. One instance is owned by one thread
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

    def vocode(
        self, z: np.ndarray, sid: np.ndarray | None, precision: str = "fp32",
        sessions: Sequence[int] | None = None,
    ) -> VocodeOut:
        """Latent window [B, C, W] -> guarded audio [B, W * hop]. `sessions` names
        each row's session (backends with per-session streams use it)."""
        ...

    def supported_precisions(self) -> tuple[str, ...]: ...
