"""TensorRT pieces that run without TensorRT, checked against the real step graph export
(the tiny multi-speaker test voice and the built-in voice): the engine's profile, which
layers the FP16 build pins to FP32 (with a stand-in for TensorRT's builder whose network is
the exported graph's nodes), engine cache keys, and clear failures where TensorRT or a GPU
is missing. The decoder around the engine is tested with ONNX Runtime in test_step_graph.py.
Where TensorRT and a GPU exist, the engines are checked against the torch decoder."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from service.models.vits.backends.registry import UnknownBackendError, create_backend
from service.models.vits.backends.step_graph import cached_step_export, is_pinned, pinned_nodes
from service.models.vits.backends.trt_backend import (
    INSTALL_HINT,
    GraphInput,
    TensorRTUnavailable,
    build_step_engine,
    pins_layer,
    plan_key,
    profile_shapes,
    read_graph_inputs,
)
from service.models.vits.precision import VITS_FP32_PINS
from service.models.vits.voice import Voice, builtin_voice_info, read_piper_voice

ROWS, FRAMES = (1, 64, 256), (1, 40, 40)


@pytest.fixture(scope="module", params=["tiny", "builtin"])
def step_onnx(request: pytest.FixtureRequest, tiny_voice_path: Path, onnx_cache_dir: str) -> Path:
    info = read_piper_voice(tiny_voice_path) if request.param == "tiny" else builtin_voice_info()
    voice = Voice(info)
    return cached_step_export(voice.model, info.model_path, Path(onnx_cache_dir))


def test_the_profile_covers_every_input_and_runs_the_graph(step_onnx: Path) -> None:
    """Every input gets a range on its dynamic axes only, and the graph runs at the profile's
    smallest shapes and at a many-rows one (ONNX Runtime stands in for the engine)."""
    inputs = read_graph_inputs(step_onnx)
    shapes = profile_shapes(inputs, ROWS, FRAMES)
    assert list(shapes) == [i.name for i in inputs]
    for inp in inputs:
        lo, opt, hi = shapes[inp.name]
        for d, a, b, c in zip(inp.dims, lo, opt, hi, strict=True):
            assert (a, b, c) == ({"rows": ROWS, "frames": FRAMES}[d] if isinstance(d, str) else (d, d, d))
    session = ort.InferenceSession(str(step_onnx), providers=["CPUExecutionProvider"])
    for k in (0, 1):
        feed = {}
        for inp in inputs:
            shape = shapes[inp.name][k]
            feed[inp.name] = (np.ones(shape, np.int64) if inp.name in ("fed", "lengths", "sid")
                              else np.zeros(shape, np.float32))
        audio = session.run(["audio"], feed)[0]
        assert audio.shape[0] == shapes["z"][k][0] and np.isfinite(audio).all()
    with pytest.raises(ValueError, match="no range for dynamic axes"):
        profile_shapes([*inputs, GraphInput("x", (1, "time"))], ROWS, FRAMES)


def test_only_floating_layers_of_pinned_modules_are_constrained() -> None:
    name = "/model/dec/conv_post/Conv"
    assert pins_layer(name, [True], VITS_FP32_PINS)
    assert not pins_layer(name, [True, False], VITS_FP32_PINS)  # an index output cannot be FP32
    assert not pins_layer(name, [], VITS_FP32_PINS)
    assert not pins_layer("/model/dec/ups/0/ConvTranspose", [True], VITS_FP32_PINS)
    assert pins_layer("/model/dec/ups/0/ConvTranspose", [True], ("dec.ups.*",))
    assert not pins_layer("(Unnamed Layer* 3) [Shuffle]", [True], ("*",))  # no module, no pin


# --- the build, with a stand-in for TensorRT ---------------------------------------------------


class _Tensor(SimpleNamespace):
    pass


class _Layer:
    def __init__(self, name: str, dtypes: list[str]) -> None:
        self.name = name
        self._outputs = [_Tensor(dtype=d) for d in dtypes]
        self.num_outputs = len(dtypes)
        self.precision: str | None = None
        self.output_types: dict[int, str] = {}

    def get_output(self, j: int) -> _Tensor:
        return self._outputs[j]

    def set_output_type(self, j: int, dtype: str) -> None:
        self.output_types[j] = dtype


class _FakeTrt:
    """The part of TensorRT's builder API `build_step_engine` uses; the network's layers are the
    step graph's nodes, named after them as TensorRT's ONNX parser names them."""

    float32, float16, int64, bool_ = "float32", "float16", "int64", "bool"
    BuilderFlag = SimpleNamespace(TF32="TF32", FP16="FP16", OBEY_PRECISION_CONSTRAINTS="OBEY")

    def __init__(self, onnx_path: Path) -> None:
        model = onnx.shape_inference.infer_shapes(onnx.load(str(onnx_path)))
        kinds = {v.name: v.type.tensor_type.elem_type for v in
                 [*model.graph.value_info, *model.graph.input, *model.graph.output]}
        kinds |= {w.name: w.data_type for w in model.graph.initializer}
        floating = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16}
        self.layers = [_Layer(n.name, [self.float32 if kinds.get(o) in floating else self.int64 for o in n.output])
                       for n in model.graph.node]
        self.flags: set[str] = {"TF32"}
        self.profile: dict[str, tuple[Any, ...]] = {}
        trt = self

        class Builder:
            def __init__(self, logger: Any) -> None:
                pass

            def create_network(self, flags: int) -> Any:
                return SimpleNamespace(num_layers=len(trt.layers), get_layer=trt.layers.__getitem__)

            def create_builder_config(self) -> Any:
                return SimpleNamespace(set_flag=trt.flags.add, clear_flag=trt.flags.discard,
                                       add_optimization_profile=lambda p: 0)

            def create_optimization_profile(self) -> Any:
                return SimpleNamespace(set_shape=lambda name, *s: trt.profile.__setitem__(name, s))

            def build_serialized_network(self, network: Any, config: Any) -> bytes:
                return b"plan"

        class OnnxParser:
            num_errors = 0

            def __init__(self, network: Any, logger: Any) -> None:
                pass

            def parse_from_file(self, path: str) -> bool:
                return path == str(onnx_path)

        self.Builder, self.OnnxParser = Builder, OnnxParser


def test_the_fp16_build_constrains_the_pinned_layers_and_nothing_else(step_onnx: Path) -> None:
    trt = _FakeTrt(step_onnx)
    shapes = profile_shapes(read_graph_inputs(step_onnx), ROWS, FRAMES)
    assert build_step_engine(trt, None, step_onnx, "fp16", VITS_FP32_PINS, shapes) == b"plan"
    assert trt.flags == {"FP16", "OBEY"}  # TF32 off: FP32 layers are real FP32
    assert trt.profile == shapes
    pinned = [layer.name for layer in trt.layers if layer.precision is not None]
    expected = [n for n in pinned_nodes([layer.name for layer in trt.layers], VITS_FP32_PINS)
                if all(t.dtype == trt.float32 for t in next(x for x in trt.layers if x.name == n)._outputs)]
    assert pinned == expected and "/model/dec/conv_post/Conv" in pinned
    assert all(layer.precision == "float32" and set(layer.output_types.values()) == {"float32"}
               for layer in trt.layers if layer.name in pinned)
    assert not any(is_pinned(n, ("flow", "dec.ups.*", "dec.resblocks.*")) for n in pinned)


def test_the_fp32_build_has_no_fp16_and_no_pins(step_onnx: Path) -> None:
    trt = _FakeTrt(step_onnx)
    shapes = profile_shapes(read_graph_inputs(step_onnx), ROWS, FRAMES)
    build_step_engine(trt, None, step_onnx, "fp32", (), shapes)
    assert trt.flags == set() and not any(layer.precision for layer in trt.layers)
    with pytest.raises(ValueError, match="unknown precision"):
        build_step_engine(_FakeTrt(step_onnx), None, step_onnx, "int8", (), shapes)


def test_pins_that_match_no_layer_fail_the_build(step_onnx: Path) -> None:
    shapes = profile_shapes(read_graph_inputs(step_onnx), ROWS, FRAMES)
    with pytest.raises(TensorRTUnavailable, match="matches the FP32 pins"):
        build_step_engine(_FakeTrt(step_onnx), None, step_onnx, "fp16", ("dec.no_such_layer",), shapes)


def test_engine_plans_are_keyed_by_everything_they_depend_on(step_onnx: Path) -> None:
    shapes = profile_shapes(read_graph_inputs(step_onnx), ROWS, FRAMES)
    base = ("fp16", VITS_FP32_PINS, shapes, "NVIDIA H200", "10.8.0")
    keys = {plan_key(step_onnx, *base),
            plan_key(step_onnx, "fp32", *base[1:]),
            plan_key(step_onnx, base[0], ("dec.conv_post",), *base[2:]),
            plan_key(step_onnx, *base[:2], profile_shapes(read_graph_inputs(step_onnx), ROWS, (1, 50, 50)), *base[3:]),
            plan_key(step_onnx, *base[:3], "NVIDIA L4", base[4]),
            plan_key(step_onnx, *base[:4], "10.9.0"),
            plan_key(step_onnx.with_name("other.onnx"), *base)}
    assert len(keys) == 7 and plan_key(step_onnx, *base) in keys


# --- without TensorRT, or on a machine that has it ----------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_missing_tensorrt_is_a_clear_error() -> None:
    voice = Voice(builtin_voice_info())
    with pytest.raises(TensorRTUnavailable, match="needs NVIDIA TensorRT 10") as info:
        create_backend("tensorrt", voice, "cuda")
    message = str(info.value)
    assert message == INSTALL_HINT
    assert "pip install" in message and "--backend torch" in message and "--backend onnxruntime" in message


def test_tensorrt_on_cpu_is_a_clear_error() -> None:
    with pytest.raises(TensorRTUnavailable, match=r"CUDA only.*--backend onnxruntime"):
        create_backend("tensorrt", Voice(builtin_voice_info()), "cpu")


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(UnknownBackendError, match="onnxruntime, tensorrt, torch"):
        create_backend("tvm", Voice(builtin_voice_info()))


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None, reason="needs TensorRT")
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_tensorrt_steps_equal_the_torch_steps(precision: str, tmp_path: Path) -> None:
    """The engines against the torch slot decoder in the same precision: equal in FP32; in FP16
    (both with the FP32 pins) as close as two FP16 implementations get."""
    from service.audio.quality import psnr_db
    from service.models.family import AcousticJob, StepRows, SynthesisParams, utterance_rng
    from service.models.registry import open_voice
    from service.models.vits.backends.torch_backend import TorchBackend

    runtime = open_voice(builtin_voice_info(), "torch", "cpu")
    (sentence,) = runtime.voice.frontend.sentences("A sentence for the engines.")  # type: ignore[attr-defined]
    utts = runtime.acoustic_batch([AcousticJob(sentence, None, SynthesisParams(seed=3),
                                               utterance_rng(3, sentence.phoneme_ids))])
    trt_backend = create_backend("tensorrt", Voice(builtin_voice_info()), "cuda", cache_dir=tmp_path)
    torch_backend = TorchBackend(Voice(builtin_voice_info()), device="cuda")
    lag = torch_backend.streaming_lag()
    a = trt_backend.streaming_decoder(precision, 2, max_rows=4, graph_frames=(20, 20 + lag))  # type: ignore[attr-defined]
    b = torch_backend.streaming_decoder(precision, 2, max_rows=4, graphs=False)
    u = utts[0]
    out: list[list[np.ndarray]] = [[], []]
    fed = 0
    for dec in (a, b):
        dec.start(0, u.prior)
    while fed - lag < u.frames:
        n = 20 + lag if fed == 0 else 20
        for i, dec in enumerate((a, b)):
            out[i].append(dec.step(StepRows([0], [fed], n, None))[0].float().cpu().numpy())
        fed += n
    x, y = (np.concatenate(p) for p in out)
    if precision == "fp32":
        assert np.abs(x - y).max() <= 1e-4
    else:
        assert psnr_db(y, x) >= 45.0
