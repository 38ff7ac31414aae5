"""The staged vocoder: chunk by chunk, each stage's output kept, equal to a full decode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.backends.torch_backend import TorchBackend
from service.streaming_vocoder import StagedVocoder
from service.voices import Voice, VoiceInfo, builtin_voice_info


@pytest.mark.parametrize("which", ["tiny", "builtin"])
def test_staged_chunks_equal_the_full_decode(which: str, tiny_voice_path: Path) -> None:
    info = VoiceInfo.from_files(tiny_voice_path) if which == "tiny" else builtin_voice_info()
    backend = TorchBackend(Voice(info))
    frames = 97
    sid = np.asarray([1]) if info.num_speakers > 1 else None
    rng = np.random.default_rng(3)
    z = (rng.standard_normal((backend.voice.model.hp.inter_channels, frames)) * 0.5).astype(np.float32)
    full = backend.vocode(z[None], sid).audio[0]
    hop = backend.voice.model.hp.hop_length
    vocoder = StagedVocoder(backend, frames, sid)
    pieces, produced = [], 0
    for end_frame in (1, 5, 6, 40, 41, 90, 97):
        end = end_frame * hop
        pieces.append(vocoder.audio(z, frames, produced, end))
        produced = end
    out = np.concatenate(pieces)
    assert out.shape == full.shape
    assert float(np.abs(out - full).max()) <= 1e-5 * max(1.0, float(np.abs(full).max()) * 1e3)


def test_lookahead_and_order_are_enforced() -> None:
    backend = TorchBackend(Voice(builtin_voice_info()))
    stages = backend.vocoder_stages()
    assert StagedVocoder.lookahead(stages) == 13  # a little over the windowed decoder's 12 frames
    vocoder = StagedVocoder(backend, 50, None)
    z = np.zeros((192, 50), dtype=np.float32)
    with pytest.raises(ValueError, match="latent frames"):
        vocoder.audio(z, 10, 0, 8 * 256)  # 8 frames of audio need 21 latent frames
    vocoder.audio(z, 50, 0, 8 * 256)
    with pytest.raises(ValueError, match="in order"):
        vocoder.audio(z, 50, 0, 16 * 256)
