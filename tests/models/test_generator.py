"""Polyphase upsamplers (used by the ONNX exports) compute the transposed convs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from service.models.vits.generator import PolyphaseUpsample, polyphase_upsamplers
from service.models.vits.onnx_import import load_vits_from_onnx
from service.models.vits.voice import builtin_voice_info


@pytest.mark.parametrize(("stride", "padding"), [(8, 4), (4, 2), (2, 1), (5, 2), (3, 0), (6, 6)])
def test_polyphase_equals_the_transposed_conv(stride: int, padding: int) -> None:
    torch.manual_seed(stride)
    up = nn.ConvTranspose1d(6, 4, 2 * stride, stride, padding=padding)
    poly = PolyphaseUpsample.from_transposed(up)
    assert poly is not None
    for length in (1, 2, 3, 17):
        x = torch.randn(2, 6, length)
        with torch.no_grad():
            want, got = up(x), poly(x)
        assert got.shape == want.shape
        if want.numel():
            assert float((got - want).abs().max()) <= 1e-5


def test_shapes_without_a_polyphase_form_are_left_alone() -> None:
    assert PolyphaseUpsample.from_transposed(nn.ConvTranspose1d(4, 4, 3, 2, padding=1)) is None
    assert PolyphaseUpsample.from_transposed(nn.ConvTranspose1d(4, 4, 8, 4, padding=2, dilation=2)) is None


def test_builtin_voice_upsamplers_all_convert() -> None:
    model = load_vits_from_onnx(builtin_voice_info().model_path).float().eval()
    dec = model.dec
    z = torch.randn(1, model.hp.inter_channels, 9)
    with torch.no_grad():
        want = dec(z)
        polyphase_upsamplers(dec)
        assert all(isinstance(up, PolyphaseUpsample) for up in dec.ups)
        got = dec(z)
    assert float((got - want).abs().max()) <= 1e-5
