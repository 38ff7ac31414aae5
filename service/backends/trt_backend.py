"""TensorRT backend: engines built from our own stage ONNX exports, an FP32 engine
and an FP16 twin whose pinned layers are constrained to FP32.

Written against TensorRT 10's documented Python API (Builder, OnnxParser, builder
config flags FP16 + OBEY_PRECISION_CONSTRAINTS, optimization profiles, the
name-based tensor API and execute_async_v3). TensorRT cannot be installed in
this project's workplace, so the parts that need it are exercised only where it
exists; without it, constructing this backend fails with a message that says
what to install or which backend to use instead.

The parts that do not need TensorRT are plain functions, tested against the real
stage exports: the shape profiles (read from each exported graph's inputs and
dynamic axes), which layers get FP32 pins, how inputs are bound, and how a call
is cut into row groups that fit a profile."""

from __future__ import annotations

import fnmatch
import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.backends.base import EncodeOut, VocodeOut, guard_host
from service.backends.stage_export import STAGES, cached_stage_exports, decoder_stage_names, default_cache_dir
from service.models.vits.precision import VITS_FP32_PINS
from service.models.vits.receptive_field import decoder_stage_table
from service.voices import Voice

log = logging.getLogger(__name__)


class TensorRTUnavailable(ValueError):
    pass


INSTALL_HINT = (
    "the tensorrt backend needs NVIDIA TensorRT 10 (`pip install \"tensorrt>=10,<11\"`, NVIDIA's wheels) "
    "and a CUDA GPU; use --backend torch on GPUs without it, or --backend onnxruntime on CPU"
)

# Bumped when what goes into an engine build changes (flags, pinning rules), so old plans are not reused.
BUILD_VERSION = "2"

# VitsModel's direct children. Node names in the staged-decoder graphs are scoped
# from the stage's own module (the flow for latent_s<i>, the generator for audio_s<i>),
# except for these, which the stage reaches through the model (the speaker embedding).
MODEL_MODULES: tuple[str, ...] = ("enc_p", "dp", "flow", "dec", "emb_g")


# --- graphs --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GraphInput:
    """One input of an exported graph: each dim is a fixed size or a dynamic axis's name."""

    name: str
    dims: tuple[int | str, ...]
    dtype: np.dtype[Any]

    @property
    def dynamic(self) -> bool:
        return any(isinstance(d, str) for d in self.dims)


def read_graph_inputs(onnx_path: Path) -> tuple[GraphInput, ...]:
    """The inputs of an ONNX graph (initializers left out), as exported."""
    import onnx
    from onnx import helper

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    weights = {init.name for init in graph.initializer}
    out = []
    for value in graph.input:
        if value.name in weights:
            continue
        tensor = value.type.tensor_type
        dims: list[int | str] = []
        for i, d in enumerate(tensor.shape.dim):
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            else:
                dims.append(d.dim_param or f"{value.name}_dim{i}")
        out.append(GraphInput(value.name, tuple(dims), np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type))))
    return tuple(out)


def read_node_names(onnx_path: Path) -> list[str]:
    import onnx

    return [node.name for node in onnx.load(str(onnx_path), load_external_data=False).graph.node]


def input_length_scales(stage_names: Sequence[str], table: Sequence[tuple[int, int, int]]) -> dict[str, int]:
    """Per staged-decoder graph: its input's length in units of latent frames (the
    product of the upsampling factors of the stages before it)."""
    if len(stage_names) != len(table):
        raise ValueError(f"{len(stage_names)} staged graphs but {len(table)} stages in the table")
    scales, scale = {}, 1
    for name, (factor, _, _) in zip(stage_names, table, strict=True):
        scales[name] = scale
        scale *= int(factor)
    return scales


def engine_precisions(graph: str) -> tuple[str, ...]:
    """Which engines a graph gets. The acoustic stage is pinned to FP32 whole (enc_p and dp);
    the staged decoder runs in FP32 only (it has no FP16 guard or fallback)."""
    return ("fp32", "fp16") if graph in ("latent", "audio") else ("fp32",)


# --- shape profiles ------------------------------------------------------------------------------

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ShapeProfile:
    """Dynamic-shape ranges for one optimization profile: (min, opt, max) per dynamic input."""

    shapes: dict[str, tuple[Shape, Shape, Shape]]
    max_batch: int

    def fits(self, inputs: Sequence[GraphInput], shapes: Mapping[str, Shape]) -> bool:
        """Whether `shapes` fit this profile on every axis but the batch (calls are cut into
        row groups of at most `max_batch` rows)."""
        for inp in inputs:
            if inp.name not in self.shapes:
                continue
            lo, _, hi = self.shapes[inp.name]
            shape = shapes[inp.name]
            for axis, dim in enumerate(inp.dims):
                if dim != "batch" and not lo[axis] <= shape[axis] <= hi[axis]:
                    return False
        return True


@dataclass(frozen=True)
class ProfileLimits:
    """What the engines accept. Decoder graphs (flow, vocoder and the staged decoder's
    stages) get two profiles: many rows of short windows (`max_batch` rows of up to
    `batch_frames` latent frames: the GPU chunk step) and a few rows of long windows
    (`long_batch` rows of up to `max_frames`). One box of `max_batch` x `max_frames`
    would size the vocoder's activation memory for 256 rows of 24 s of audio (tens of
    GiB per execution context). Calls with more rows than a profile takes are cut
    into row groups."""

    max_batch: int = 256  # decoder rows per engine call (short windows)
    batch_frames: int = 256  # latent frames per row at up to max_batch rows
    long_batch: int = 8  # decoder rows per engine call at up to max_frames
    max_frames: int = 2048  # latent frames per row (a chunk's window with its context)
    encoder_max_batch: int = 8  # sentences per encoder call (the engine batches up to 8)
    max_phonemes: int = 1024  # phoneme ids per sentence
    opt_frames: int = 128  # the window length kernels are tuned for
    opt_phonemes: int = 128

    def __post_init__(self) -> None:
        bad = [name for name, value in vars(self).items() if not isinstance(value, int) or value < 1]
        if bad:
            raise ValueError(f"profile limits must be positive integers: {', '.join(bad)}")
        if self.batch_frames > self.max_frames:
            raise ValueError(f"batch_frames ({self.batch_frames}) exceeds max_frames ({self.max_frames})")

    def decoder_boxes(self) -> list[tuple[int, int, int, int]]:
        """(max rows, max frames, opt rows, opt frames) per decoder profile, long windows first."""
        long_rows = min(self.long_batch, self.max_batch)
        boxes = [(long_rows, self.max_frames, min(8, long_rows), min(self.opt_frames, self.max_frames))]
        if self.max_batch > long_rows:
            boxes.append((self.max_batch, self.batch_frames, min(64, self.max_batch),
                          min(self.opt_frames, self.batch_frames)))
        return boxes


def stage_profiles(
    graphs: Mapping[str, Sequence[GraphInput]], length_scales: Mapping[str, int], limits: ProfileLimits,
) -> dict[str, tuple[ShapeProfile, ...]]:
    """Optimization profiles for every exported graph, from its inputs' dynamic axes:
    `batch`, `phonemes` (the prior), `frames` (flow and vocoder windows) and `length`
    (a staged-decoder stage's input: latent frames times `length_scales[graph]`).
    Staged graphs are called one row at a time, so their opt batch is 1."""
    out: dict[str, tuple[ShapeProfile, ...]] = {}
    for graph, inputs in graphs.items():
        staged = graph not in STAGES
        if graph == "prior":
            boxes = [(limits.encoder_max_batch, 0, 1, 0)]
        else:
            boxes = limits.decoder_boxes()
        profiles = []
        for rows, frames, opt_rows, opt_frames in boxes:
            axes: dict[str, tuple[int, int, int]] = {"batch": (1, 1 if staged else opt_rows, rows)}
            if graph == "prior":
                axes["phonemes"] = (1, min(limits.opt_phonemes, limits.max_phonemes), limits.max_phonemes)
            elif staged:
                if graph not in length_scales:
                    raise ValueError(f"no input length scale for staged graph {graph!r}")
                s = length_scales[graph]
                axes["length"] = (1, opt_frames * s, frames * s)
            else:
                axes["frames"] = (1, opt_frames, frames)
            shapes: dict[str, tuple[Shape, Shape, Shape]] = {}
            for inp in inputs:
                if not inp.dynamic:
                    continue
                unknown = [d for d in inp.dims if isinstance(d, str) and d not in axes]
                if unknown:
                    raise ValueError(f"graph {graph!r} input {inp.name!r}: no range for dynamic axes {unknown}")
                lo, opt, hi = (tuple(d if isinstance(d, int) else axes[d][k] for d in inp.dims) for k in range(3))
                shapes[inp.name] = (lo, opt, hi)
            profiles.append(ShapeProfile(shapes, rows))
        out[graph] = tuple(profiles)
    return out


def row_groups(rows: int, max_rows: int) -> list[slice]:
    """Consecutive row slices of at most max_rows each."""
    return [slice(start, min(rows, start + max_rows)) for start in range(0, rows, max_rows)]


def plan_call(
    graph: str, inputs: Sequence[GraphInput], profiles: Sequence[ShapeProfile], shapes: Mapping[str, Shape],
    rows: int,
) -> tuple[int, list[slice]]:
    """The profile a call runs under and its row groups: among the profiles its
    non-batch dims fit, the tightest one that takes all rows at once, else the one
    that takes the most rows per group."""
    fitting = [i for i, p in enumerate(profiles) if p.fits(inputs, shapes)]
    if not fitting:
        ranges = "; ".join(
            f"profile {i}: " + ", ".join(f"{name} {lo}..{hi}" for name, (lo, _, hi) in p.shapes.items())
            for i, p in enumerate(profiles)
        )
        got = ", ".join(f"{name} {tuple(shape)}" for name, shape in shapes.items())
        raise ValueError(
            f"the {graph} engine has no optimization profile for {got} ({ranges}); "
            "raise the TensorRT backend's max_frames / max_phonemes"
        )
    whole = [i for i in fitting if profiles[i].max_batch >= rows]
    if whole:
        best = min(whole, key=lambda i: profiles[i].max_batch)
    else:
        best = max(fitting, key=lambda i: profiles[i].max_batch)
    return best, row_groups(rows, profiles[best].max_batch)


# --- binding -------------------------------------------------------------------------------------


def bind_inputs(
    graph: str, inputs: Sequence[GraphInput], feed: Mapping[str, np.ndarray | None], rows: int,
) -> dict[str, np.ndarray]:
    """The arrays a graph is run on: its own inputs only (an export drops `sid` where
    the stage does not use it), in the graph's dtypes, contiguous, with every
    `batch` axis `rows` long. A speaker id of None (default speaker) or of one row
    is given to every row."""
    out: dict[str, np.ndarray] = {}
    for inp in inputs:
        value = feed.get(inp.name)
        if inp.name == "sid":
            sid = np.zeros(rows, dtype=np.int64) if value is None else np.asarray(value).reshape(-1)
            if sid.shape[0] == 1 and rows != 1:
                sid = np.broadcast_to(sid, (rows,))
            value = sid
        if value is None:
            raise ValueError(f"the {graph} graph needs input {inp.name!r}")
        arr = np.ascontiguousarray(value, dtype=inp.dtype)
        if arr.ndim != len(inp.dims):
            raise ValueError(f"{graph} input {inp.name!r}: rank {arr.ndim}, the graph takes {inp.dims}")
        for axis, (got, want) in enumerate(zip(arr.shape, inp.dims, strict=True)):
            expect = rows if want == "batch" else want
            if isinstance(expect, int) and got != expect:
                raise ValueError(
                    f"{graph} input {inp.name!r}: axis {axis} is {got}, the graph takes {expect} "
                    f"(shape {arr.shape}, dims {inp.dims}, {rows} rows)"
                )
        out[inp.name] = arr
    return out


def encode_feed(
    ids: np.ndarray, lengths: np.ndarray, dp_noise: np.ndarray, sid: np.ndarray | None,
) -> tuple[dict[str, np.ndarray | None], int]:
    """The prior graph's feed for an encoder batch, and its rows."""
    return {"ids": ids, "lengths": lengths, "dp_noise": dp_noise, "sid": sid}, int(np.shape(ids)[0])


# --- FP32 pins -----------------------------------------------------------------------------------


def graph_module_root(graph: str) -> str:
    """The module a graph's node names are scoped from: the flow for latent_s<i>, the
    generator for audio_s<i>, the whole model for the others."""
    if graph.startswith("latent_s"):
        return "flow"
    if graph.startswith("audio_s"):
        return "dec"
    return ""


def layer_module(layer_name: str, root: str = "", top_level: Sequence[str] = MODEL_MODULES) -> str:
    """ONNX-derived layer name -> model module path: '/dec/conv_post/Conv' -> 'dec.conv_post';
    in a generator stage graph (root 'dec'), '/conv_post/Conv' -> 'dec.conv_post'.
    Unscoped names (initializer copies, parser helpers) belong to no module."""
    if not layer_name.startswith("/"):
        return ""
    parts = [p for p in layer_name.split("/") if p][:-1]
    if not parts:
        return root
    if not root or parts[0] in top_level:
        return ".".join(parts)
    return ".".join([root, *parts])


def is_pinned(layer_name: str, pins: Sequence[str], root: str = "", top_level: Sequence[str] = MODEL_MODULES) -> bool:
    """True when the layer belongs to a pinned module (or one inside it)."""
    module = layer_module(layer_name, root, top_level)
    while module:
        if any(fnmatch.fnmatchcase(module, p) for p in pins):
            return True
        module = module.rpartition(".")[0]
    return False


def pinned_nodes(
    graph: str, node_names: Sequence[str], pins: Sequence[str], top_level: Sequence[str] = MODEL_MODULES,
) -> list[str]:
    """The nodes (TensorRT layers are named after them) of `graph` kept in FP32."""
    root = graph_module_root(graph)
    return [n for n in node_names if is_pinned(n, pins, root, top_level)]


def pins_layer(layer_name: str, outputs_floating: Sequence[bool], graph: str, pins: Sequence[str],
               top_level: Sequence[str] = MODEL_MODULES) -> bool:
    """Whether a TensorRT layer gets an FP32 constraint: it belongs to a pinned module and
    all its outputs are floating point (an FP32 output type on a shape or index layer
    would make the build fail)."""
    return bool(outputs_floating) and all(outputs_floating) and is_pinned(
        layer_name, pins, graph_module_root(graph), top_level
    )


# --- the backend ---------------------------------------------------------------------------------


def _import_trt() -> Any:
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise TensorRTUnavailable(INSTALL_HINT) from exc
    major = str(getattr(trt, "__version__", "0")).split(".")[0]
    if not major.isdigit() or int(major) < 10:
        raise TensorRTUnavailable(f"found TensorRT {getattr(trt, '__version__', '?')}; {INSTALL_HINT}")
    return trt


class TensorRTBackend:
    name = "tensorrt"

    def __init__(
        self, voice: Voice, device: str = "cuda", threads: int | None = None, pins: Sequence[str] = VITS_FP32_PINS,
        max_batch: int = 256, encoder_max_batch: int = 8, max_frames: int = 2048, max_phonemes: int = 1024,
        limits: ProfileLimits | None = None, cache_dir: Path | None = None,
    ) -> None:
        """`max_batch`: rows per decoder engine call (short windows; a few rows at a time
        up to `max_frames`); `encoder_max_batch`: sentences per encoder call. Bigger
        calls are cut into row groups. `limits` overrides all four. `threads` is
        accepted for the common backend options and unused."""
        if not device.startswith("cuda"):
            raise TensorRTUnavailable(
                f"the tensorrt backend runs on CUDA only (got device {device!r}); use --backend onnxruntime on CPU"
            )
        trt = _import_trt()
        import torch

        if not torch.cuda.is_available():
            raise TensorRTUnavailable(f"torch sees no CUDA GPU for device {device!r}; {INSTALL_HINT}")
        self.trt = trt
        self.torch = torch
        self.device = device
        self._device = torch.device(device)
        self.voice = voice
        self.pins = tuple(pins)
        self.fp32_pins = self.pins
        self.limits = limits or ProfileLimits(
            max_batch=max_batch, encoder_max_batch=encoder_max_batch, max_frames=max_frames,
            max_phonemes=max_phonemes, batch_frames=min(ProfileLimits.batch_frames, max_frames),
        )
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)  # kept: engines must not outlive their runtime
        self._cache = cache_dir or default_cache_dir()
        self._paths = cached_stage_exports(voice.model, voice.info.onnx_path, self._cache)
        self._inputs = {graph: read_graph_inputs(path) for graph, path in self._paths.items()}
        self._stage_table = decoder_stage_table(voice.model)
        self._stage_names = decoder_stage_names(voice.model)
        self.profiles = stage_profiles(
            self._inputs, input_length_scales(self._stage_names, self._stage_table), self.limits
        )
        self._top_level = tuple(dict.fromkeys([*MODEL_MODULES, *(name for name, _ in voice.model.named_children())]))
        self._engines: dict[tuple[str, str], Any] = {}
        self._contexts: dict[tuple[str, str, int], Any] = {}
        # The batched path's engines are built (or loaded) now, so a graph TensorRT cannot
        # take fails at startup; the staged decoder's on first use.
        for graph in STAGES:
            for precision in engine_precisions(graph):
                self._engine(graph, precision)

    def supported_precisions(self) -> tuple[str, ...]:
        return ("fp32", "fp16")

    def decoder_stages(self) -> list[tuple[int, int, int]]:
        return self._stage_table

    # -- building ------------------------------------------------------------------------------

    def _engine(self, graph: str, precision: str) -> Any:
        key = (graph, precision)
        if key not in self._engines:
            if precision not in engine_precisions(graph):
                raise ValueError(f"no {precision} engine for the {graph} graph (has {engine_precisions(graph)})")
            with self.torch.cuda.device(self._device):
                self._engines[key] = self._load_or_build(graph, precision)
        return self._engines[key]

    def _load_or_build(self, graph: str, precision: str) -> Any:
        trt, onnx_path = self.trt, self._paths[graph]
        gpu = self.torch.cuda.get_device_name(self._device)
        profiles = self.profiles[graph]
        # The export folder's name carries the voice digest and export version; engines are
        # specific to the GPU, the TensorRT version, the pins and the profiles.
        key = hashlib.sha256(
            f"{BUILD_VERSION}|{onnx_path.parent.name}|{graph}|{precision}|{self.pins}|{gpu}|{trt.__version__}|"
            f"{[(p.shapes, p.max_batch) for p in profiles]}".encode()
        ).hexdigest()[:16]
        plan = onnx_path.parent / f"{graph}-{precision}-{key}.plan"
        if not plan.is_file():
            log.info("building TensorRT %s engine for %s (%s)", precision, graph, onnx_path.parent.name)
            tmp = plan.with_name(plan.name + ".tmp")
            tmp.write_bytes(self._build(graph, onnx_path, profiles, precision))
            tmp.replace(plan)
        engine = self._runtime.deserialize_cuda_engine(plan.read_bytes())
        if engine is None:
            raise TensorRTUnavailable(f"TensorRT could not load engine {plan}; delete it to rebuild")
        return engine

    def _build(self, graph: str, onnx_path: Path, profiles: Sequence[ShapeProfile], precision: str) -> bytes:
        trt = self.trt
        builder = trt.Builder(self._logger)
        network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
        parser = trt.OnnxParser(network, self._logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise TensorRTUnavailable(f"TensorRT could not parse {onnx_path}: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 2 << 30)
        # FP32 must mean FP32 (as in the torch backend): TF32 keeps 10 mantissa bits, and
        # both the FP32 engine and the FP16 engine's pinned layers are the numerical safety net.
        config.clear_flag(trt.BuilderFlag.TF32)
        if precision == "fp16":
            config.set_flag(trt.BuilderFlag.FP16)
            config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
            floating = (trt.float32, trt.float16, trt.bfloat16)
            pinned = 0
            for i in range(network.num_layers):
                layer = network.get_layer(i)
                outputs = [layer.get_output(j) for j in range(layer.num_outputs)]
                if pins_layer(layer.name, [o.dtype in floating for o in outputs], graph, self.pins, self._top_level):
                    layer.precision = trt.float32
                    for j in range(layer.num_outputs):
                        layer.set_output_type(j, trt.float32)
                    pinned += 1
            log.info("%s: %d layers pinned to FP32", onnx_path.name, pinned)
        for profile in profiles:
            opt_profile = builder.create_optimization_profile()
            for name, (lo, opt, hi) in profile.shapes.items():
                opt_profile.set_shape(name, lo, opt, hi)
            if config.add_optimization_profile(opt_profile) < 0:
                raise TensorRTUnavailable(f"TensorRT rejected an optimization profile for {onnx_path}: {profile}")
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise TensorRTUnavailable(f"TensorRT failed to build an engine from {onnx_path}")
        return bytes(serialized)

    def _context(self, graph: str, precision: str, profile: int) -> Any:
        key = (graph, precision, profile)
        if key not in self._contexts:
            engine = self._engine(graph, precision)
            trt = self.trt
            # Each context holds activation memory for its own profile only (STATIC would size
            # every context for the largest profile of the engine).
            context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.ON_PROFILE_CHANGE)
            if context is None:
                raise RuntimeError(f"TensorRT could not create an execution context for the {graph} engine")
            stream = self.torch.cuda.current_stream(self._device)
            if not context.set_optimization_profile_async(profile, stream.cuda_stream):
                raise RuntimeError(f"TensorRT could not select profile {profile} of the {graph} engine")
            stream.synchronize()
            self._contexts[key] = context
        return self._contexts[key]

    # -- running -------------------------------------------------------------------------------

    def _run(
        self, graph: str, precision: str, feed: Mapping[str, np.ndarray | None], rows: int
    ) -> dict[str, np.ndarray]:
        if precision not in ("fp32", "fp16"):
            raise ValueError(f"unknown precision {precision!r}; use fp32 or fp16")
        inputs = self._inputs[graph]
        bound = bind_inputs(graph, inputs, feed, rows)
        profile, groups = plan_call(graph, inputs, self.profiles[graph], {k: v.shape for k, v in bound.items()}, rows)
        with self.torch.cuda.device(self._device):
            parts = [self._execute(graph, precision, profile, {k: v[g] for k, v in bound.items()}) for g in groups]
        if len(parts) == 1:
            return parts[0]
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def _execute(self, graph: str, precision: str, profile: int, bound: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch, trt = self.torch, self.trt
        engine = self._engine(graph, precision)
        context = self._context(graph, precision, profile)
        keep = []
        outputs: dict[str, Any] = {}
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        for name in names:
            if engine.get_tensor_mode(name) != trt.TensorIOMode.INPUT:
                continue
            if name not in bound:
                raise RuntimeError(f"the {graph} engine takes input {name!r}, which its ONNX graph does not")
            host = np.ascontiguousarray(bound[name], dtype=trt.nptype(engine.get_tensor_dtype(name)))
            tensor = torch.from_numpy(host).to(self._device)
            if not context.set_input_shape(name, tuple(tensor.shape)):
                raise RuntimeError(f"the {graph} engine rejected shape {tuple(tensor.shape)} for {name!r}")
            context.set_tensor_address(name, tensor.data_ptr())
            keep.append(tensor)
        for name in names:
            if engine.get_tensor_mode(name) != trt.TensorIOMode.OUTPUT:
                continue
            shape = tuple(context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise RuntimeError(f"the {graph} engine could not infer the shape of output {name!r}: {shape}")
            dtype = torch.from_numpy(np.empty(0, dtype=trt.nptype(engine.get_tensor_dtype(name)))).dtype
            outputs[name] = torch.empty(shape, dtype=dtype, device=self._device)
            context.set_tensor_address(name, outputs[name].data_ptr())
        stream = torch.cuda.current_stream(self._device)
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"TensorRT execution of the {graph} graph failed")
        stream.synchronize()
        return {name: (t.float() if t.is_floating_point() else t).cpu().numpy() for name, t in outputs.items()}

    def encode(
        self, ids: np.ndarray, lengths: np.ndarray, dp_noise: np.ndarray, sid: np.ndarray | None
    ) -> EncodeOut:
        feed, rows = encode_feed(ids, lengths, dp_noise, sid)
        out = self._run("prior", "fp32", feed, rows)
        return EncodeOut(out["m_p"], out["logs_p"], out["logw"])

    def flow(self, z_p: np.ndarray, sid: np.ndarray | None, precision: str = "fp32") -> np.ndarray:
        return self._run("latent", precision, {"z_p": z_p, "sid": sid}, int(z_p.shape[0]))["z"]

    def vocode(
        self, z: np.ndarray, sid: np.ndarray | None, precision: str = "fp32", sessions: Sequence[int] | None = None
    ) -> VocodeOut:
        audio = self._run("audio", precision, {"z": z, "sid": sid}, int(z.shape[0]))["audio"]
        return guard_host(audio, precision)

    def decode_stage(self, index: int, x: np.ndarray, sid: np.ndarray | None) -> np.ndarray:
        """One flow coupling or generator stage in FP32 (the staged streaming path)."""
        return self._run(self._stage_names[index], "fp32", {"x": x, "sid": sid}, int(x.shape[0]))["y"]
