"""Mixed precision for VITS: FP16 almost everywhere, FP32 where numbers are fragile.

A pinned module keeps FP32 weights and computes in FP32: its floating inputs are
cast up on the way in and its outputs cast back to the half dtype on the way out.
The pin list below is justified by `cadenza precision sensitivity`, which serves FP16 sessions
with each pin taken out and each other candidate added and reports the waveform PSNR."""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from service.models.vits.model import VitsModel

# Module-name patterns (fnmatch) kept in FP32 in the FP16 decoder. The acoustic stage (`enc_p`,
# `dp`) is not among them because it always runs in FP32, whole (durations go through exp() and
# ceil(): one rounding flip moves a frame boundary and shifts all later audio; it is per phoneme,
# so FP32 costs little there). Why each pin:
# - emb_g: speaker embedding lookup (multi-speaker voices), tiny.
# - dec.conv_post: the output conv feeding tanh; its accumulation over 32 channels x 7 taps
#   decides the final sample values.
# `cadenza precision sensitivity` measures each on the served path (bench/RESULTS.md).
VITS_FP32_PINS: tuple[str, ...] = ("emb_g", "dec.conv_post")

# What the sensitivity tool tries: modules the served decoder calls as a whole (a pin works by
# casting at a module's call, and the streaming decoder calls the flow's couplings' parts and the
# generator's layers one stage at a time, never `flow` or `dec` themselves).
VITS_PIN_CANDIDATES: tuple[str, ...] = (
    "emb_g", "flow.flows.*.pre", "flow.flows.*.enc", "flow.flows.*.post", "dec.conv_pre", "dec.cond",
    "dec.ups.*", "dec.resblocks.*", "dec.conv_post",
)


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
    model: VitsModel, pins: Sequence[str] = VITS_FP32_PINS, dtype: torch.dtype = torch.float16
) -> VitsModel:
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
