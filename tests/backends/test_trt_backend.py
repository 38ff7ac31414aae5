"""TensorRT pieces that run without TensorRT: pin matching, shape profiles, and a
clear failure when it is not installed (it cannot be installed in this workplace)."""

from __future__ import annotations

import importlib.util

import pytest

from service.backends.registry import UnknownBackendError, create_backend
from service.backends.trt_backend import TensorRTUnavailable, is_pinned, layer_module, stage_profiles
from service.models.vits.precision import VITS_FP32_PINS
from service.voices import Voice, builtin_voice_info


def test_layer_names_map_to_modules_and_pins() -> None:
    assert layer_module("/dec/conv_post/Conv") == "dec.conv_post"
    assert layer_module("/enc_p/encoder/attn_layers.0/Softmax") == "enc_p.encoder.attn_layers.0"
    assert is_pinned("/dec/conv_post/Conv", VITS_FP32_PINS)
    assert is_pinned("/dp/flows.3/convs/convs_sep.0/Conv", VITS_FP32_PINS)  # inside a pinned module
    assert not is_pinned("/dec/resblocks.3/convs.1/Conv", VITS_FP32_PINS)
    assert not is_pinned("/flow/flows.0/enc/in_layers.0/Conv", VITS_FP32_PINS)
    assert not is_pinned("Conv_12", VITS_FP32_PINS)


def test_profiles_cover_min_opt_max() -> None:
    profiles = stage_profiles(192, max_batch=64, max_frames=2048)
    lo, opt, hi = profiles["audio"].shapes["z"]
    assert lo == (1, 192, 1) and hi == (64, 192, 2048)
    assert all(a <= b <= c for a, b, c in zip(lo, opt, hi, strict=True))
    assert set(profiles) == {"prior", "latent", "audio"}


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_missing_tensorrt_is_a_clear_error() -> None:
    with pytest.raises(TensorRTUnavailable, match="needs NVIDIA TensorRT"):
        create_backend("tensorrt", Voice(builtin_voice_info()), "cuda")


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(UnknownBackendError, match="onnxruntime, tensorrt, torch"):
        create_backend("tvm", Voice(builtin_voice_info()))
