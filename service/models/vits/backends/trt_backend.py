"""TensorRT backend: the slot decoder's step (`step_graph.DecoderStep`, the graph the torch
backend captures as CUDA graphs) as TensorRT engines, one per precision: FP32, and FP16 with
the voice's FP32 pins as per-layer precision constraints. The acoustic stage (pinned to FP32
whole) and the FP32 reference windows (shadow checks) run in the torch backend this one
extends, on the same GPU; FP16 runs only in the engines, so a chunk marked FP16 came from one.

Written against TensorRT 10's documented Python API (Builder, OnnxParser, builder flags
FP16 + OBEY_PRECISION_CONSTRAINTS, one optimization profile, the name-based tensor API and
execute_async_v3). TensorRT cannot be installed in this project's workplace: what does not
need it (the export, the decoder around the engine, which layers are pinned, the profile's
shapes) is tested with ONNX Runtime running the same graph; without it, this backend fails
saying what to install or which backend to use instead."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.models.vits.backends.stage_export import default_cache_dir
from service.models.vits.backends.step_graph import GraphStepDecoder, cached_step_export, is_pinned
from service.models.vits.backends.torch_backend import TorchBackend
from service.models.vits.precision import VITS_FP32_PINS
from service.models.vits.voice import Voice

log = logging.getLogger(__name__)


class TensorRTUnavailable(ValueError):
    pass


INSTALL_HINT = (
    "the tensorrt backend needs NVIDIA TensorRT 10 (`pip install \"tensorrt>=10,<11\"`, NVIDIA's wheels) "
    "and a CUDA GPU; use --backend torch on GPUs without it, or --backend onnxruntime on CPU"
)

# Bumped when what goes into an engine build changes (flags, pinning rules), so old plans are not reused.
BUILD_VERSION = "3"

Shape = tuple[int, ...]


@dataclass(frozen=True)
class GraphInput:
    """One input of an exported graph: each dim is a fixed size or a dynamic axis's name."""

    name: str
    dims: tuple[int | str, ...]


def read_graph_inputs(onnx_path: Path) -> tuple[GraphInput, ...]:
    """The inputs of an ONNX graph (initializers left out), as exported."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    weights = {init.name for init in graph.initializer}
    out = []
    for value in graph.input:
        if value.name not in weights:
            dims = tuple(int(d.dim_value) if d.HasField("dim_value") else d.dim_param
                         for d in value.type.tensor_type.shape.dim)
            out.append(GraphInput(value.name, dims))
    return tuple(out)


def profile_shapes(inputs: Sequence[GraphInput], rows: tuple[int, int, int],
                   frames: tuple[int, int, int]) -> dict[str, tuple[Shape, Shape, Shape]]:
    """(min, opt, max) shape of every input of the step graph, for `rows` and `frames` given as
    (min, opt, max)."""
    axes = {"rows": rows, "frames": frames}
    out = {}
    for inp in inputs:
        unknown = [d for d in inp.dims if isinstance(d, str) and d not in axes]
        if unknown:
            raise ValueError(f"step graph input {inp.name!r}: no range for dynamic axes {unknown}")
        lo, opt, hi = (tuple(d if isinstance(d, int) else axes[d][k] for d in inp.dims) for k in range(3))
        out[inp.name] = (lo, opt, hi)
    return out


def pins_layer(layer_name: str, outputs_floating: Sequence[bool], pins: Sequence[str]) -> bool:
    """Whether a TensorRT layer (named after its ONNX node) gets an FP32 constraint: it belongs
    to a pinned module and all its outputs are floating point (an FP32 output type on a shape
    or index layer would make the build fail)."""
    return bool(outputs_floating) and all(outputs_floating) and is_pinned(layer_name, pins)


def plan_key(onnx_path: Path, precision: str, pins: Sequence[str], shapes: Mapping[str, Any], gpu: str,
             trt_version: str) -> str:
    """What an engine depends on: the export (its folder names the voice digest), the precision,
    pins and profile, the GPU and the TensorRT version."""
    text = f"{BUILD_VERSION}|{onnx_path.parent.name}/{onnx_path.name}|{precision}|{tuple(pins)}|" \
           f"{sorted(shapes.items())}|{gpu}|{trt_version}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _import_trt() -> Any:
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise TensorRTUnavailable(INSTALL_HINT) from exc
    # 10 only: the FP16 builder flag and per-layer precision constraints this build relies on are
    # TensorRT 10's weakly typed networks, which later versions deprecate.
    if str(getattr(trt, "__version__", "0")).split(".")[0] != "10":
        raise TensorRTUnavailable(f"found TensorRT {getattr(trt, '__version__', '?')}; {INSTALL_HINT}")
    return trt


def build_step_engine(trt: Any, logger: Any, onnx_path: Path, precision: str, pins: Sequence[str],
                      shapes: Mapping[str, tuple[Shape, Shape, Shape]]) -> bytes:
    """A serialized engine of the step graph: FP32 throughout, or FP16 with the pinned layers
    constrained to FP32 (inputs and outputs stay FP32 in both)."""
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TensorRTUnavailable(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    # FP32 must mean FP32 (as in the torch backend): TF32 keeps 10 mantissa bits, and both the
    # FP32 engine and the FP16 engine's pinned layers are the numerical safety net.
    config.clear_flag(trt.BuilderFlag.TF32)
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
        config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        floating = (trt.float32, trt.float16)
        pinned = 0
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            outputs = [layer.get_output(j) for j in range(layer.num_outputs)]
            if pins_layer(layer.name, [o.dtype in floating for o in outputs], pins):
                layer.precision = trt.float32
                for j in range(layer.num_outputs):
                    layer.set_output_type(j, trt.float32)
                pinned += 1
        if pins and not pinned:
            raise TensorRTUnavailable(f"no layer of {onnx_path} matches the FP32 pins {tuple(pins)}")
        log.info("%s: %d layers pinned to FP32", onnx_path.name, pinned)
    elif precision != "fp32":
        raise ValueError(f"unknown precision {precision!r}; use fp32 or fp16")
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    if config.add_optimization_profile(profile) < 0:
        raise TensorRTUnavailable(f"TensorRT rejected the optimization profile for {onnx_path}: {shapes}")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise TensorRTUnavailable(f"TensorRT failed to build a {precision} engine from {onnx_path}")
    return bytes(serialized)


class EngineStep:
    """Runs the step graph's engine on device tensors, queued on the current CUDA stream (the
    decoder's gathers before it and scatters after it are ordered by that stream)."""

    def __init__(self, trt: Any, engine: Any, device: Any) -> None:
        import torch

        self.torch, self.device, self.engine = torch, device, engine
        self.context = engine.create_execution_context()
        if self.context is None:
            raise RuntimeError("TensorRT could not create an execution context for the step engine")
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.dtypes = {n: torch.from_numpy(np.empty(0, dtype=trt.nptype(engine.get_tensor_dtype(n)))).dtype
                       for n in names}

    def __call__(self, feed: Mapping[str, Any]) -> dict[str, Any]:
        torch, context = self.torch, self.context
        for name in self.inputs:
            tensor = feed[name]
            if tensor.dtype != self.dtypes[name] or not tensor.is_contiguous():
                raise ValueError(f"step engine input {name!r}: {tensor.dtype} (contiguous: "
                                 f"{tensor.is_contiguous()}), the engine takes {self.dtypes[name]}")
            if not context.set_input_shape(name, tuple(tensor.shape)):
                raise RuntimeError(f"the step engine rejected shape {tuple(tensor.shape)} for {name!r}")
            context.set_tensor_address(name, tensor.data_ptr())
        out = {}
        for name in self.outputs:
            out[name] = torch.empty(tuple(context.get_tensor_shape(name)), dtype=self.dtypes[name],
                                    device=self.device)
            context.set_tensor_address(name, out[name].data_ptr())
        if not context.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
            raise RuntimeError("TensorRT execution of the decoder step failed")
        return out


class TensorRTBackend(TorchBackend):
    name = "tensorrt"

    def __init__(self, voice: Voice, device: str = "cuda", threads: int | None = None,
                 pins: Sequence[str] = VITS_FP32_PINS, cache_dir: Path | None = None, **options: Any) -> None:
        """`cache_dir`: where the step graph and its engines are kept. Other options are the
        torch backend's (it runs the acoustic stage)."""
        if not device.startswith("cuda"):
            raise TensorRTUnavailable(
                f"the tensorrt backend runs on CUDA only (got device {device!r}); use --backend onnxruntime on CPU"
            )
        self.trt = _import_trt()
        # Exported before the torch backend moves the model to the GPU.
        self._step_onnx = cached_step_export(voice.model, voice.info.model_path, cache_dir or default_cache_dir())
        super().__init__(voice, device, threads, pins, **options)
        self.fp32_pins = self.pins
        self._logger = self.trt.Logger(self.trt.Logger.WARNING)
        self._runtime = self.trt.Runtime(self._logger)  # kept: engines must not outlive their runtime
        self._engines: dict[tuple[str, int, int], Any] = {}

    def streaming_decoder(self, precision: str, capacity: int, max_rows: int = 256, graphs: bool = True,
                          graph_frames: Sequence[int] = ()) -> GraphStepDecoder:
        """A slot decoder whose steps run this precision's engine. The engine takes 1 to `max_rows`
        rows of 1 to max(`graph_frames`) frames (longer steps run as several); `graphs` is the
        torch backend's option and has no meaning here."""
        import torch

        if precision not in self.supported_precisions():
            raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(self.supported_precisions())}")
        max_frames = max(graph_frames, default=64)
        engine = self._engine(precision, max_rows, max_frames)
        buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b < max_rows] + [max_rows]
        with torch.cuda.device(self._device):
            run = EngineStep(self.trt, engine, self._device)
        return GraphStepDecoder(self.models["fp32"], precision, capacity, self._device, run, max_frames,
                                graph_frames=graph_frames, buckets=buckets)

    def _engine(self, precision: str, max_rows: int, max_frames: int) -> Any:
        key = (precision, max_rows, max_frames)
        if key not in self._engines:
            import torch

            shapes = profile_shapes(read_graph_inputs(self._step_onnx), (1, min(64, max_rows), max_rows),
                                    (1, max_frames, max_frames))
            pins = self.pins if precision == "fp16" else ()
            gpu = torch.cuda.get_device_name(self._device)
            digest = plan_key(self._step_onnx, precision, pins, shapes, gpu, self.trt.__version__)
            plan = self._step_onnx.with_name(f"{self._step_onnx.stem}-{precision}-{digest}.plan")
            with torch.cuda.device(self._device):
                if not plan.is_file():
                    log.info("building the TensorRT %s decoder engine (%s)", precision, plan.name)
                    tmp = plan.with_name(f"{plan.name}.{os.getpid()}.tmp")  # concurrent builders never mix
                    tmp.write_bytes(build_step_engine(self.trt, self._logger, self._step_onnx, precision, pins,
                                                      shapes))
                    tmp.replace(plan)
                engine = self._runtime.deserialize_cuda_engine(plan.read_bytes())
            if engine is None:
                raise TensorRTUnavailable(f"TensorRT could not load engine {plan}; delete it to rebuild")
            self._engines[key] = engine
        return self._engines[key]

    def flow(self, z_p: np.ndarray, sid: np.ndarray | None, precision: str = "fp32") -> np.ndarray:
        return super().flow(z_p, sid, self._reference(precision))

    def vocode(self, z: np.ndarray, sid: np.ndarray | None, precision: str = "fp32") -> Any:
        return super().vocode(z, sid, self._reference(precision))

    def _reference(self, precision: str) -> str:
        """Whole-utterance decodes are the torch FP32 reference: FP16 runs only in the engines."""
        if precision != "fp32":
            raise ValueError(f"the tensorrt backend decodes {precision} in its streaming decoder's engines only; "
                             "its reference decode is FP32")
        return precision
