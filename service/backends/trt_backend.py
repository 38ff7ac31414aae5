"""TensorRT backend: engines built from our own stage ONNX exports, an FP32 engine
and an FP16 twin whose pinned layers are constrained to FP32.

Written against TensorRT 10's documented Python API (Builder, OnnxParser, builder
config flags FP16 + OBEY_PRECISION_CONSTRAINTS, optimization profiles, the
name-based tensor API and execute_async_v3). TensorRT cannot be installed in
this project's workplace, so the parts that need it are exercised only where it
exists; without it, constructing this backend fails with a message that says
what to install or which backend to use instead."""

from __future__ import annotations

import fnmatch
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.backends.base import EncodeOut, VocodeOut, guard_host
from service.backends.ort_backend import default_cache_dir
from service.backends.stage_export import cached_stage_exports
from service.models.vits.precision import VITS_FP32_PINS
from service.voices import Voice

log = logging.getLogger(__name__)


class TensorRTUnavailable(ValueError):
    pass


INSTALL_HINT = (
    "the tensorrt backend needs NVIDIA TensorRT 10 (`pip install tensorrt` from NVIDIA's index) and a CUDA GPU; "
    "use --backend torch on GPUs without it, or --backend onnxruntime on CPU"
)


@dataclass(frozen=True)
class ShapeProfile:
    """Dynamic-shape ranges for one engine: (min, opt, max) per input."""

    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def stage_profiles(channels: int, max_batch: int = 64, max_frames: int = 2048, max_ids: int = 1024) -> dict[
        str, ShapeProfile]:
    """min/opt/max shapes: optimised for a mid-size chunk batch, valid up to the limits."""
    opt_b = max(1, min(8, max_batch))
    return {
        "prior": ShapeProfile({
            "ids": ((1, 1), (1, 160), (1, max_ids)), "lengths": ((1,), (1,), (1,)),
            "dp_noise": ((1, 2, 1), (1, 2, 160), (1, 2, max_ids)), "sid": ((1,), (1,), (1,)),
        }),
        "latent": ShapeProfile({
            "z_p": ((1, channels, 1), (opt_b, channels, 200), (max_batch, channels, max_frames)),
            "sid": ((1,), (opt_b,), (max_batch,)),
        }),
        "audio": ShapeProfile({
            "z": ((1, channels, 1), (opt_b, channels, 152), (max_batch, channels, max_frames)),
            "sid": ((1,), (opt_b,), (max_batch,)),
        }),
    }


def layer_module(layer_name: str) -> str:
    """ONNX-derived layer name -> module path: '/dec/conv_post/Conv' -> 'dec.conv_post'."""
    parts = [p for p in layer_name.split("/") if p]
    return ".".join(parts[:-1]) if len(parts) > 1 else ""


def is_pinned(layer_name: str, pins: Sequence[str]) -> bool:
    """True when the layer belongs to a pinned module (or one inside it)."""
    module = layer_module(layer_name)
    while module:
        if any(fnmatch.fnmatchcase(module, p) for p in pins):
            return True
        module = module.rpartition(".")[0]
    return False


def _import_trt() -> Any:
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise TensorRTUnavailable(INSTALL_HINT) from exc
    return trt


class TensorRTBackend:
    name = "tensorrt"

    def __init__(
        self, voice: Voice, device: str = "cuda", threads: int | None = None, pins: Sequence[str] = VITS_FP32_PINS,
        max_batch: int = 64, cache_dir: Path | None = None,
    ) -> None:
        trt = _import_trt()
        import torch

        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise TensorRTUnavailable(f"the tensorrt backend runs on CUDA only (got device {device!r}); {INSTALL_HINT}")
        self.trt = trt
        self.torch = torch
        self.device = device
        self.voice = voice
        self.pins = tuple(pins)
        self._logger = trt.Logger(trt.Logger.WARNING)
        cache = cache_dir or default_cache_dir()
        onnx_paths = cached_stage_exports(voice.model, voice.info.onnx_path, cache)
        profiles = stage_profiles(voice.model.hp.inter_channels, max_batch)
        self._engines: dict[tuple[str, str], Any] = {}
        for stage, path in onnx_paths.items():
            precisions = ("fp32",) if stage == "prior" else ("fp32", "fp16")  # the acoustic stage is pinned whole
            for precision in precisions:
                self._engines[(stage, precision)] = self._load_or_build(path, profiles[stage], precision, cache)
        self._contexts = {key: engine.create_execution_context() for key, engine in self._engines.items()}

    def supported_precisions(self) -> tuple[str, ...]:
        return ("fp32", "fp16")

    # -- building ------------------------------------------------------------------------------

    def _load_or_build(self, onnx_path: Path, profile: ShapeProfile, precision: str, cache: Path) -> Any:
        trt = self.trt
        gpu = self.torch.cuda.get_device_name(self.torch.device(self.device))
        # The export folder's name carries the voice digest; engines are specific to GPU and TensorRT version.
        key = hashlib.sha256(
            f"{onnx_path.parent.name}|{onnx_path.name}|{precision}|{self.pins}|{gpu}|{trt.__version__}".encode()
        ).hexdigest()[:16]
        plan = cache / f"{onnx_path.parent.name}-{onnx_path.stem}-{precision}-{key}.plan"
        runtime = trt.Runtime(self._logger)
        if not plan.is_file():
            plan.write_bytes(self._build(onnx_path, profile, precision))
        engine = runtime.deserialize_cuda_engine(plan.read_bytes())
        if engine is None:
            raise TensorRTUnavailable(f"TensorRT could not load engine {plan}; delete it to rebuild")
        return engine

    def _build(self, onnx_path: Path, profile: ShapeProfile, precision: str) -> bytes:
        trt = self.trt
        builder = trt.Builder(self._logger)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, self._logger)
        if not parser.parse(onnx_path.read_bytes()):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise TensorRTUnavailable(f"TensorRT could not parse {onnx_path}: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 2 << 30)
        if precision == "fp16":
            config.set_flag(trt.BuilderFlag.FP16)
            config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
            pinned = 0
            for i in range(network.num_layers):
                layer = network.get_layer(i)
                if is_pinned(layer.name, self.pins):
                    layer.precision = trt.float32
                    for j in range(layer.num_outputs):
                        layer.set_output_type(j, trt.float32)
                    pinned += 1
            log.info("%s: %d layers pinned to FP32", onnx_path.name, pinned)
        opt_profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in profile.shapes.items():
            opt_profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(opt_profile)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise TensorRTUnavailable(f"TensorRT failed to build an engine from {onnx_path}")
        return bytes(serialized)

    # -- running -------------------------------------------------------------------------------

    def _run(self, stage: str, precision: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self.torch
        engine = self._engines[(stage, precision)]
        context = self._contexts[(stage, precision)]
        dev = torch.device(self.device)
        keep = []
        outputs: dict[str, Any] = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            if engine.get_tensor_mode(name) == self.trt.TensorIOMode.INPUT:
                tensor = torch.as_tensor(np.ascontiguousarray(inputs[name]), device=dev)
                context.set_input_shape(name, tuple(tensor.shape))
                context.set_tensor_address(name, tensor.data_ptr())
                keep.append(tensor)
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            if engine.get_tensor_mode(name) == self.trt.TensorIOMode.OUTPUT:
                shape = tuple(context.get_tensor_shape(name))
                dtype = torch.float16 if engine.get_tensor_dtype(name) == self.trt.float16 else torch.float32
                outputs[name] = torch.empty(shape, dtype=dtype, device=dev)
                context.set_tensor_address(name, outputs[name].data_ptr())
        stream = torch.cuda.current_stream(dev)
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"TensorRT execution of the {stage} stage failed")
        stream.synchronize()
        return {name: t.float().cpu().numpy() for name, t in outputs.items()}

    @staticmethod
    def _sid(sid: np.ndarray | None, batch: int) -> np.ndarray:
        return np.zeros(batch, dtype=np.int64) if sid is None else np.asarray(sid, dtype=np.int64)

    def encode(
        self, ids: np.ndarray, lengths: np.ndarray, dp_noise: np.ndarray, sid: np.ndarray | None
    ) -> EncodeOut:
        out = self._run("prior", "fp32", {"ids": ids.astype(np.int64), "lengths": lengths.astype(np.int64),
                                          "dp_noise": dp_noise.astype(np.float32), "sid": self._sid(sid, 1)})
        return EncodeOut(out["m_p"], out["logs_p"], out["logw"])

    def flow(self, z_p: np.ndarray, sid: np.ndarray | None, precision: str = "fp32") -> np.ndarray:
        return self._run("latent", precision, {"z_p": z_p.astype(np.float32), "sid": self._sid(sid, z_p.shape[0])})["z"]

    def vocode(
        self, z: np.ndarray, sid: np.ndarray | None, precision: str = "fp32", sessions: Sequence[int] | None = None
    ) -> VocodeOut:
        audio = self._run("audio", precision, {"z": z.astype(np.float32), "sid": self._sid(sid, z.shape[0])})["audio"]
        return guard_host(audio, precision)
