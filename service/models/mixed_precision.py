"""Mixed precision for any family's torch model: FP16 almost everywhere, FP32 where numbers
are fragile.

A pinned module keeps FP32 weights and computes in FP32: its floating inputs are cast up on the
way in and its outputs cast back to the half dtype on the way out. Which modules a family pins is
its own choice, justified by `cadenza precision sensitivity` on the served path."""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

M = TypeVar("M", bound=nn.Module)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    if isinstance(value, list):
        return [_cast(v, dtype) for v in value]
    return value


def _matching(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Names of modules matching any pattern, outermost only (no pin inside a pin).
    Containers (ModuleList/ModuleDict) are never called, so their children stand in."""
    names = [n for n, _ in model.named_modules() if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    outer = [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]
    called: list[str] = []
    for name in outer:
        module = model.get_submodule(name)
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            called += [f"{name}.{child}" for child, _ in module.named_children()]
        else:
            called.append(name)
    return called


def pinned_modules(model: nn.Module, pins: Sequence[str]) -> list[str]:
    return _matching(model, pins)


def to_mixed_precision(
    model: M, pins: Sequence[str], dtype: torch.dtype = torch.float16
) -> M:
    """A copy of `model` in `dtype` with the pinned modules kept in FP32."""
    mixed = copy.deepcopy(model).to(dtype)
    for name in _matching(mixed, pins):
        module = mixed.get_submodule(name)
        module.float()
        module.register_forward_pre_hook(_input_caster(torch.float32), with_kwargs=True)
        module.register_forward_hook(_output_caster(dtype))
    return mixed.eval()


_Args = tuple[Any, ...]
_Kwargs = dict[str, Any]


def _input_caster(dtype: torch.dtype) -> Callable[[nn.Module, _Args, _Kwargs], tuple[_Args, _Kwargs]]:
    def hook(module: nn.Module, args: _Args, kwargs: _Kwargs) -> tuple[_Args, _Kwargs]:
        return tuple(_cast(a, dtype) for a in args), {k: _cast(v, dtype) for k, v in kwargs.items()}

    return hook


def _output_caster(dtype: torch.dtype) -> Callable[[nn.Module, Any, Any], Any]:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        return _cast(output, dtype)

    return hook


def no_tf32() -> None:
    """FP32 matrix products and convolutions on CUDA without TF32, for the whole process. PyTorch
    lets cuDNN convolutions use TF32 by default: a 10-bit mantissa, no better than FP16 (in
    CosyVoice2's flow it changes the waveform as much as FP16 does), rounded differently for each
    batch shape, while the FP32 path is every family's reference and numerical safety net."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
