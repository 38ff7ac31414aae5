"""The staged decoder: chunk by chunk, each flow coupling's and generator stage's
output kept, equal to a full flow + vocoder decode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.models.vits.backends.torch_backend import TorchBackend
from service.models.vits.staged import StagedDecoder
from service.models.vits.voice import Voice, builtin_voice_info, read_piper_voice


@pytest.mark.parametrize(
    ("which", "piece"), [("tiny", 0), ("builtin", 0), ("builtin", 30), ("tiny", 64)]
)
def test_staged_chunks_equal_the_full_decode(which: str, piece: int, tiny_voice_path: Path) -> None:
    info = read_piper_voice(tiny_voice_path) if which == "tiny" else builtin_voice_info()
    backend = TorchBackend(Voice(info))
    frames = 97
    sid = np.asarray([1]) if info.num_speakers > 1 else None
    rng = np.random.default_rng(3)
    z_p = (rng.standard_normal((backend.voice.model.hp.inter_channels, frames)) * 0.8).astype(np.float32)
    full = backend.vocode(backend.flow(z_p[None], sid), sid).audio[0]
    hop = backend.voice.model.hp.hop_length
    decoder = StagedDecoder(backend, z_p, sid, flow_piece_frames=piece)
    pieces, produced = [], 0
    for end_frame in (1, 5, 6, 40, 41, 90, 97):
        end = end_frame * hop
        pieces.append(decoder.audio(produced, end))
        produced = end
    out = np.concatenate(pieces)
    assert out.shape == full.shape
    # README: chunked audio equals a full decode to <= 1e-4. Measured (CPU, FP32): at most
    # 8.8e-7 on the built-in voice (peak ~0.11) and 1.7e-10 on the tiny one (peak ~6.4e-4),
    # so the claim is checked as is, and relative to the peak too (the tiny voice is quiet).
    err, peak = float(np.abs(out - full).max()), float(np.abs(full).max())
    assert peak > 0
    assert err <= 1e-4, err
    assert err <= 1e-4 * peak, (err, peak)


def test_stage_table_and_order_are_enforced() -> None:
    backend = TorchBackend(Voice(builtin_voice_info()))
    stages = backend.decoder_stages()
    # Four couplings (4 WaveNet layers, kernel 5: 8 frames of context each), then
    # conv_pre and three upsampling stages (8, 8, 4: 256 samples per frame).
    assert [(f, c) for f, c, _ in stages[:4]] == [(1, 8)] * 4
    assert [f for f, _, _ in stages[4:]] == [1, 8, 8, 4]
    decoder = StagedDecoder(backend, np.zeros((192, 50), dtype=np.float32), None)
    decoder.audio(0, 8 * 256)
    with pytest.raises(ValueError, match="in order"):
        decoder.audio(0, 16 * 256)
    with pytest.raises(ValueError, match="outside"):
        decoder.audio(8 * 256, 51 * 256)
