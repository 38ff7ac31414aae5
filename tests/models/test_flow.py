"""The folded flow couplings used by the ONNX exports compute the trained couplings."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from service.models.vits.flow import FoldedCoupling, fold_couplings
from service.models.vits.onnx_import import load_vits_from_onnx
from service.models.vits.voice import builtin_voice_info


@pytest.mark.parametrize("which", ["tiny", "builtin"])
def test_folded_couplings_match_the_trained_ones(which: str, tiny_voice_path: Path) -> None:
    path = tiny_voice_path if which == "tiny" else builtin_voice_info().model_path
    model = load_vits_from_onnx(path).float().eval()
    folded = copy.deepcopy(model)
    fold_couplings(folded.flow)
    assert all(isinstance(folded.flow.coupling(i), FoldedCoupling) for i in range(folded.flow.num_stages))
    channels, frames = model.hp.inter_channels, 61
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(2, channels, frames, generator=gen)
    mask = torch.ones(2, 1, frames)
    mask[1, :, 40:] = 0  # a padded batch row: the fold must keep padding and edges exact
    g = model.speaker_embedding(torch.tensor([1, 0])) if model.emb_g is not None else None
    with torch.inference_mode():
        for i in range(model.flow.num_stages):
            want = model.flow.stage(i, z, g)
            got = folded.flow.stage(i, z, g)
            assert float((want - got).abs().max()) <= 1e-4 * max(1.0, float(want.abs().max()))
            want_m = model.flow.stage(i, z * mask, g, mask)
            got_m = folded.flow.stage(i, z * mask, g, mask)
            assert float((want_m - got_m).abs().max()) <= 1e-4 * max(1.0, float(want_m.abs().max()))
            # ...and it is not the identity: the coupling changed its input.
            assert float((got - torch.flip(z, [1])).abs().max()) > 1e-3
