"""TensorRT pieces that run without TensorRT, checked against our real stage exports
(the tiny multi-speaker test voice and the built-in voice): shape profiles for every
exported graph, which nodes get FP32 pins, input binding, row groups, and a clear
failure when TensorRT is not installed (it cannot be installed in this workplace)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest

from service.backends.registry import UnknownBackendError, create_backend
from service.backends.stage_export import STAGES, cached_stage_exports, decoder_stage_names
from service.backends.trt_backend import (
    MODEL_MODULES,
    GraphInput,
    ProfileLimits,
    ShapeProfile,
    TensorRTUnavailable,
    bind_inputs,
    encode_feed,
    engine_precisions,
    graph_module_root,
    input_length_scales,
    is_pinned,
    layer_module,
    pinned_nodes,
    pins_layer,
    plan_call,
    read_graph_inputs,
    read_node_names,
    row_groups,
    stage_profiles,
)
from service.models.vits.precision import VITS_FP32_PINS, pinned_modules
from service.models.vits.receptive_field import decoder_stage_table
from service.voices import Voice, VoiceInfo, builtin_voice_info

LIMITS = ProfileLimits()


class Exports:
    def __init__(self, voice: Voice, cache: Path) -> None:
        self.voice = voice
        self.paths = cached_stage_exports(voice.model, voice.info.onnx_path, cache)
        self.inputs = {g: read_graph_inputs(p) for g, p in self.paths.items()}
        self.nodes = {g: read_node_names(p) for g, p in self.paths.items()}
        self.table = decoder_stage_table(voice.model)
        self.stage_names = decoder_stage_names(voice.model)
        self.scales = input_length_scales(self.stage_names, self.table)

    def profiles(self, limits: ProfileLimits = LIMITS) -> dict[str, tuple[ShapeProfile, ...]]:
        return stage_profiles(self.inputs, self.scales, limits)


@pytest.fixture(scope="module")
def tiny(tiny_voice_path: Path, onnx_cache_dir: str) -> Exports:
    return Exports(Voice(VoiceInfo.from_files(tiny_voice_path)), Path(onnx_cache_dir))


@pytest.fixture(scope="module")
def builtin(onnx_cache_dir: str) -> Exports:
    return Exports(Voice(builtin_voice_info()), Path(onnx_cache_dir))


@pytest.fixture(params=["tiny", "builtin"])
def exports(request: pytest.FixtureRequest) -> Exports:
    result: Exports = request.getfixturevalue(request.param)
    return result


# --- graphs and profiles -------------------------------------------------------------------------


def test_exports_are_the_graphs_the_backend_knows(exports: Exports) -> None:
    model = exports.voice.model
    assert list(exports.paths) == [*STAGES, *exports.stage_names]
    assert len(exports.paths) == 3 + model.flow.num_stages + model.dec.num_stages
    assert {name for name, _ in model.named_children()} | {"emb_g"} == set(MODEL_MODULES)  # emb_g: multi-speaker
    assert engine_precisions("prior") == ("fp32",)
    assert engine_precisions("latent") == engine_precisions("audio") == ("fp32", "fp16")
    assert all(engine_precisions(g) == ("fp32",) for g in exports.stage_names)


def test_profiles_cover_every_graph_and_dynamic_input(exports: Exports) -> None:
    profiles = exports.profiles()
    assert set(profiles) == set(exports.paths)  # latent_s0, audio_s3, ...: no KeyError
    hop = exports.voice.hop_length
    for graph, inputs in exports.inputs.items():
        dynamic = {i.name for i in inputs if i.dynamic}
        assert dynamic, graph
        for profile in profiles[graph]:
            assert set(profile.shapes) == dynamic, graph
            axes: dict[str, set[tuple[int, int, int]]] = {}
            for inp in inputs:
                lo, opt, hi = profile.shapes[inp.name]
                assert len(lo) == len(opt) == len(hi) == len(inp.dims), (graph, inp.name)
                for axis, dim in enumerate(inp.dims):
                    assert 1 <= lo[axis] <= opt[axis] <= hi[axis], (graph, inp.name, axis)
                    if isinstance(dim, int):
                        assert lo[axis] == opt[axis] == hi[axis] == dim
                    else:
                        axes.setdefault(dim, set()).add((lo[axis], opt[axis], hi[axis]))
            # An axis named alike in several inputs (batch, phonemes) gets one range.
            assert all(len(ranges) == 1 for ranges in axes.values()), (graph, axes)
            (batch,) = axes["batch"]
            assert batch[2] == profile.max_batch
    assert [p.max_batch for p in profiles["prior"]] == [8]
    assert profiles["prior"][0].shapes["ids"][2] == (8, LIMITS.max_phonemes)
    for graph in ("latent", "audio", *exports.stage_names):
        assert [p.max_batch for p in profiles[graph]] == [8, 256], graph
    name = "z_p"
    assert [p.shapes[name][2][2] for p in profiles["latent"]] == [2048, 256]
    # Staged inputs are sample-rate signals: their lengths scale with the upsampling before them.
    last = exports.stage_names[-1]
    assert exports.scales[exports.stage_names[0]] == 1
    assert exports.scales[last] * exports.table[-1][0] == hop
    assert profiles[last][0].shapes["x"][2][2] == 2048 * hop // exports.table[-1][0]


def test_profile_shapes_run_the_real_graphs(tiny: Exports) -> None:
    """Every profile's min and opt shapes are valid inputs of the graph (ranks, fixed
    channel dims, dtypes): ONNX Runtime runs each graph on them."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    for graph, profiles in tiny.profiles().items():
        sess = ort.InferenceSession(str(tiny.paths[graph]), providers=["CPUExecutionProvider"])
        inputs = {i.name: i for i in tiny.inputs[graph]}
        for profile in profiles:
            for which in (0, 1):  # min, opt
                feed = {}
                for name, shapes in profile.shapes.items():
                    shape, dtype = shapes[which], inputs[name].dtype
                    if name == "lengths":
                        feed[name] = np.full(shape, profile.shapes["ids"][which][1], dtype=dtype)
                    elif dtype.kind == "i":
                        feed[name] = np.ones(shape, dtype=dtype)
                    else:
                        feed[name] = (rng.standard_normal(shape) * 0.1).astype(dtype)
                out = sess.run(None, feed)
                rows = next(iter(profile.shapes.values()))[which][0]
                assert all(o.shape[0] == rows for o in out), (graph, which)


def test_limits_are_checked_and_shape_the_profiles(tiny: Exports) -> None:
    with pytest.raises(ValueError, match="positive"):
        ProfileLimits(max_batch=0)
    with pytest.raises(ValueError, match="batch_frames"):
        ProfileLimits(max_frames=100, batch_frames=200)
    one = tiny.profiles(ProfileLimits(max_batch=8))  # no wide profile when it would take no more rows
    assert all(len(p) == 1 for p in one.values())
    prior = tiny.profiles(ProfileLimits(encoder_max_batch=16, max_phonemes=400))["prior"][0]
    assert prior.shapes["ids"] == ((1, 1), (1, 128), (16, 400))
    assert prior.shapes["dp_noise"][2] == (16, 2, 400)
    bad = {"latent": (GraphInput("z_p", ("batch", 4, "time"), np.dtype(np.float32)),)}
    with pytest.raises(ValueError, match="time"):
        stage_profiles(bad, {}, LIMITS)


def test_calls_run_under_a_fitting_profile_in_row_groups(builtin: Exports) -> None:
    inputs = builtin.inputs["latent"]
    profiles = builtin.profiles()["latent"]
    c = builtin.voice.model.hp.inter_channels

    def plan(rows: int, frames: int) -> tuple[int, list[int]]:
        index, groups = plan_call("latent", inputs, profiles, {"z_p": (rows, c, frames)}, rows)
        return index, [g.stop - g.start for g in groups]

    assert plan(1, 1100) == (0, [1])  # a long window: the long profile
    assert plan(8, 100) == (0, [8])  # both fit and take every row: the tighter one
    assert plan(64, 100) == (1, [64])  # the GPU chunk step: many short rows at once
    assert plan(300, 100) == (1, [256, 44])
    assert plan(20, 1100) == (0, [8, 8, 4])  # long rows beyond 8: cut into groups
    with pytest.raises(ValueError, match="max_frames"):
        plan(1, 5000)
    assert row_groups(3, 8) == [slice(0, 3)]
    assert row_groups(0, 8) == []


# --- FP32 pins -----------------------------------------------------------------------------------


def test_layer_names_map_to_modules_and_pins() -> None:
    assert layer_module("/dec/conv_post/Conv") == "dec.conv_post"
    assert layer_module("/enc_p/encoder/attn_layers.0/Softmax") == "enc_p.encoder.attn_layers.0"
    assert layer_module("/conv_post/Conv", root="dec") == "dec.conv_post"  # a generator stage graph
    assert layer_module("/emb_g/Gather", root="flow") == "emb_g"  # reached through the model
    assert layer_module("/LeakyRelu", root="dec") == "dec"
    assert layer_module("Identity_36", root="dec") == ""
    assert is_pinned("/dec/conv_post/Conv", VITS_FP32_PINS)
    assert is_pinned("/conv_post/Conv", VITS_FP32_PINS, root="dec")
    assert is_pinned("/dp/flows.3/convs/convs_sep.0/Conv", VITS_FP32_PINS)  # inside a pinned module
    assert not is_pinned("/flows.3/enc/in_layers.0/Conv", VITS_FP32_PINS, root="flow")  # the flow's, not dp's
    assert not is_pinned("/dec/resblocks.3/convs.1/Conv", VITS_FP32_PINS)
    assert not is_pinned("/flow/flows.0/enc/in_layers.0/Conv", VITS_FP32_PINS)
    assert not is_pinned("Conv_12", VITS_FP32_PINS)
    # Only layers with floating outputs get an FP32 constraint (shape/index layers would fail the build).
    assert pins_layer("/dec/conv_post/Conv", [True], "audio", VITS_FP32_PINS)
    assert not pins_layer("/enc_p/Shape", [False], "prior", VITS_FP32_PINS)
    assert not pins_layer("/dec/conv_post/Conv", [], "audio", VITS_FP32_PINS)


def _expected_pins(graph: str) -> tuple[str, ...]:
    """The node-name prefixes of VITS_FP32_PINS' modules as each graph scopes them."""
    if graph in STAGES:
        return ("/enc_p/", "/dp/", "/emb_g/", "/dec/conv_post/")
    if graph.startswith("latent_s"):
        return ("/emb_g/",)
    return ("/emb_g/", "/conv_post/")


def test_fp32_pins_pick_the_pinned_modules_nodes_and_no_others(exports: Exports) -> None:
    multi = exports.voice.model.emb_g is not None
    torch_side = set(pinned_modules(exports.voice.model, VITS_FP32_PINS))  # what the torch backend pins
    hit: set[str] = set()
    for graph, nodes in exports.nodes.items():
        pinned = pinned_nodes(graph, nodes, VITS_FP32_PINS)
        assert pinned == [n for n in nodes if n.startswith(_expected_pins(graph))], graph
        for n in pinned:
            module = layer_module(n, graph_module_root(graph))
            hit.add(next(m for m in torch_side if module == m or module.startswith(m + ".")))
    # The same modules the torch backend's mixed precision keeps in FP32, every one of them.
    assert hit == torch_side
    ops = {g: {n.name: n.op_type for n in onnx.load(str(p)).graph.node} for g, p in exports.paths.items()}
    # The acoustic stage: every encoder and duration-predictor node, nothing else but the speaker lookup.
    prior = pinned_nodes("prior", exports.nodes["prior"], VITS_FP32_PINS)
    assert any(n.startswith("/enc_p/encoder/") for n in prior) and any(n.startswith("/dp/") for n in prior)
    assert "Softmax" in {ops["prior"][n] for n in prior}
    # The vocoder: its output conv, in the whole-vocoder graph and in the last generator stage.
    last = exports.stage_names[-1]
    for graph, name in (("audio", "/dec/conv_post/Conv"), (last, "/conv_post/Conv")):
        conv = [n for n in pinned_nodes(graph, exports.nodes[graph], VITS_FP32_PINS) if ops[graph][n] == "Conv"]
        assert conv == [name], graph
    for graph in exports.stage_names[:-1]:  # no other generator stage has a pinned conv
        assert not any(ops[graph][n] == "Conv" for n in pinned_nodes(graph, exports.nodes[graph], VITS_FP32_PINS))
    # The flow is not pinned: only the speaker lookup, where the voice has speakers.
    for graph in ("latent", *[g for g in exports.stage_names if g.startswith("latent_s")]):
        got = pinned_nodes(graph, exports.nodes[graph], VITS_FP32_PINS)
        assert {ops[graph][n] for n in got} == ({"Gather"} if multi else set()), graph


def test_other_pins_follow_the_staged_graphs_scopes(tiny: Exports) -> None:
    for graph in tiny.stage_names:
        nodes = tiny.nodes[graph]
        whole_flow = pinned_nodes(graph, nodes, ("flow",))
        if graph.startswith("latent_s"):  # every scoped node of a coupling but the speaker lookup
            assert whole_flow == [n for n in nodes if n.startswith("/") and not n.startswith("/emb_g/")]
        else:
            assert whole_flow == []
        resblocks = pinned_nodes(graph, nodes, ("dec.resblocks.*",))
        assert resblocks == [n for n in nodes if n.startswith("/resblocks.")]
    full = pinned_nodes("audio", tiny.nodes["audio"], ("dec.resblocks.*",))
    assert full and full == [n for n in tiny.nodes["audio"] if n.startswith("/dec/resblocks.")]


# --- binding -------------------------------------------------------------------------------------


def test_encode_binds_the_batchs_speaker_ids(tiny: Exports) -> None:
    import onnxruntime as ort

    inputs = tiny.inputs["prior"]
    t = 11
    ids = np.random.default_rng(1).integers(3, 20, (3, t))
    lengths = np.array([t, t - 2, t - 5])
    dp_noise = np.zeros((3, 2, t), dtype=np.float32)
    feed, rows = encode_feed(ids, lengths, dp_noise, np.array([0, 1, 2]))
    bound = bind_inputs("prior", inputs, feed, rows)
    assert rows == 3
    assert bound["sid"].shape == (3,) and bound["sid"].dtype == np.int64
    assert bound["sid"].tolist() == [0, 1, 2]
    assert bound["ids"].dtype == np.int64 and bound["dp_noise"].dtype == np.float32
    assert all(a.flags.c_contiguous for a in bound.values())
    # The default speaker, or one speaker for the batch, is every row's.
    assert bind_inputs("prior", inputs, encode_feed(ids, lengths, dp_noise, None)[0], 3)["sid"].tolist() == [0] * 3
    assert bind_inputs("prior", inputs, encode_feed(ids, lengths, dp_noise, np.array([2]))[0], 3)["sid"].tolist() \
        == [2] * 3
    with pytest.raises(ValueError, match="sid"):
        bind_inputs("prior", inputs, encode_feed(ids, lengths, dp_noise, np.array([0, 1]))[0], 3)
    with pytest.raises(ValueError, match="dp_noise"):
        bind_inputs("prior", inputs, encode_feed(ids, lengths, dp_noise[:, :1], None)[0], 3)
    sess = ort.InferenceSession(str(tiny.paths["prior"]), providers=["CPUExecutionProvider"])
    m_p, _, _ = sess.run(None, bound)
    assert m_p.shape[0] == 3
    # Row groups of a bound feed are feeds of the same graph.
    part = {k: v[row_groups(3, 2)[1]] for k, v in bound.items()}
    assert part["sid"].tolist() == [2] and part["ids"].shape == (1, t)


def test_single_speaker_graphs_bind_no_speaker_id(builtin: Exports) -> None:
    z = np.zeros((2, builtin.voice.model.hp.inter_channels, 5))
    bound = bind_inputs("latent", builtin.inputs["latent"], {"z_p": z, "sid": None}, 2)
    assert set(bound) == {"z_p"} and bound["z_p"].dtype == np.float32
    with pytest.raises(ValueError, match="z_p"):
        bind_inputs("latent", builtin.inputs["latent"], {"z": z}, 2)


# --- without TensorRT ----------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_missing_tensorrt_is_a_clear_error() -> None:
    voice = Voice(builtin_voice_info())
    with pytest.raises(TensorRTUnavailable, match="needs NVIDIA TensorRT 10") as info:
        create_backend("tensorrt", voice, "cuda")
    message = str(info.value)
    assert "pip install" in message and "--backend torch" in message and "--backend onnxruntime" in message


def test_tensorrt_on_cpu_is_a_clear_error() -> None:
    with pytest.raises(TensorRTUnavailable, match=r"CUDA only.*--backend onnxruntime"):
        create_backend("tensorrt", Voice(builtin_voice_info()), "cpu")


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(UnknownBackendError, match="onnxruntime, tensorrt, torch"):
        create_backend("tvm", Voice(builtin_voice_info()))
