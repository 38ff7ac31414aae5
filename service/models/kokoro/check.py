"""A Kokoro voice against the official `KModel` (`cadenza voices check`): the official model holds
our weights (dequantised from the int8 graph), and both get the same phoneme ids, the same style
row, speed 1 and the same sine-source noise (the official model draws it from torch's global
generator; `official_noise` replays those draws), so they differ only by the port."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from service.models.kokoro.official import official_model
from service.models.kokoro.runtime import KokoroRuntime
from service.models.kokoro.voices import VOICE_ROWS
from service.text.frontend import PhonemizedSentence

SEED = 0


def official_noise(seed: int, batch: int, samples: int) -> torch.Tensor:
    """The sine-source noise the official decoder draws after `torch.manual_seed(seed)`: an
    initial phase (`rand`, never read by its frame-rate phase), then `randn_like` of a tensor
    laid out harmonic-major, which fills values in another order than `randn` of its shape."""
    torch.manual_seed(seed)
    torch.rand(batch, 9)
    return torch.randn_like(torch.empty(batch, 9, samples).transpose(1, 2))


class KokoroParity:
    description = "official KModel (kokoro 0.9.4) with the same weights, style row and source noise"

    def __init__(self, runtime: KokoroRuntime, threads: int | None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.runtime = runtime
        self.model = runtime.model
        self.official: Any = official_model(runtime.model.state_dict()).to(runtime.device)

    @torch.inference_mode()
    def pair(self, sentence: PhonemizedSentence) -> tuple[np.ndarray, np.ndarray]:
        ids = torch.tensor([sentence.phoneme_ids], dtype=torch.long, device=self.runtime.device)
        style = self.runtime.pack[min(max(len(sentence.phonemes) - 1, 0), VOICE_ROWS - 1), 0][None]
        torch.manual_seed(SEED)
        original, _ = self.official.forward_with_tokens(ids, style, 1.0)
        out = self.model.acoustic(ids, style, 1.0)
        noise = official_noise(SEED, 1, out.asr.shape[-1] * self.model.samples_per_frame).to(self.runtime.device)
        ours = self.model.decode(out.asr, out.f0, out.n, style, noise)
        return original.reshape(-1).float().cpu().numpy(), ours[0].float().cpu().numpy()
