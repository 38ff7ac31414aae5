"""PyTorch backend: runs our VitsModel on CPU or CUDA."""

from __future__ import annotations

import numpy as np
import torch

from service.backends.base import EncodeOut, VocodeOut
from service.voices import Voice


def _sid(sid: np.ndarray | None, device: torch.device) -> torch.Tensor | None:
    return None if sid is None else torch.as_tensor(sid, dtype=torch.long, device=device)


class TorchBackend:
    name = "torch"

    def __init__(self, voice: Voice, device: str = "cpu", threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.device = device
        self._device = torch.device(device)
        self.voice = voice
        self.model = voice.model.to(self._device).eval()

    def supported_precisions(self) -> tuple[str, ...]:
        return ("fp32",)

    @torch.inference_mode()
    def encode(
        self, ids: np.ndarray, lengths: np.ndarray, dp_noise: np.ndarray, sid: np.ndarray | None
    ) -> EncodeOut:
        dev = self._device
        m_p, logs_p, logw, _ = self.model.encode(
            torch.as_tensor(ids, device=dev), torch.as_tensor(lengths, device=dev),
            torch.as_tensor(dp_noise, device=dev), _sid(sid, dev),
        )
        return EncodeOut(m_p.float().cpu().numpy(), logs_p.float().cpu().numpy(),
                         logw.float().cpu().numpy())

    @torch.inference_mode()
    def flow(self, z_p: np.ndarray, sid: np.ndarray | None, precision: str = "fp32") -> np.ndarray:
        dev = self._device
        z = torch.as_tensor(z_p, device=dev)
        mask = torch.ones(z.shape[0], 1, z.shape[2], device=dev)
        return self.model.flow_reverse(z, mask, _sid(sid, dev)).float().cpu().numpy()

    @torch.inference_mode()
    def vocode(self, z: np.ndarray, sid: np.ndarray | None, precision: str = "fp32") -> VocodeOut:
        dev = self._device
        audio = self.model.vocode(torch.as_tensor(z, device=dev), _sid(sid, dev))
        return guard_to_numpy(audio, "fp32")


def guard_to_numpy(audio: torch.Tensor, precision: str) -> VocodeOut:
    """Count non-finite samples per row, zero them, find the peak, copy to host."""
    audio = audio.float()
    finite = torch.isfinite(audio)
    nonfinite = (~finite).sum(dim=1)
    clean = torch.where(finite, audio, torch.zeros_like(audio))
    peak = clean.abs().amax(dim=1) if clean.shape[1] else torch.zeros(clean.shape[0])
    return VocodeOut(
        audio=clean.cpu().numpy(), nonfinite=nonfinite.cpu().numpy(), peak=peak.cpu().numpy(),
        precision=precision,
    )
