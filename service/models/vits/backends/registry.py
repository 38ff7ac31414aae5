"""Backends by name, imported lazily so nothing touches CUDA, onnxruntime or
TensorRT until that backend is asked for."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.models.vits.backends.base import Backend
    from service.models.vits.voice import Voice

_BACKENDS: dict[str, str] = {
    "torch": "service.models.vits.backends.torch_backend:TorchBackend",
    "onnxruntime": "service.models.vits.backends.ort_backend:OrtBackend",
    "tensorrt": "service.models.vits.backends.trt_backend:TensorRTBackend",
}


class UnknownBackendError(ValueError):
    pass


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def create_backend(name: str, voice: Voice, device: str = "cpu", **options: object) -> Backend:
    """Instantiate backend `name` for `voice` on `device` ("cpu", "cuda", "cuda:1")."""
    if name not in _BACKENDS:
        raise UnknownBackendError(
            f"unknown backend {name!r}; choose one of: {', '.join(backend_names())} (--backend)"
        )
    module_name, _, cls_name = _BACKENDS[name].partition(":")
    factory: Callable[..., Backend] = getattr(importlib.import_module(module_name), cls_name)
    return factory(voice, device=device, **options)
