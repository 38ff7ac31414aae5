"""Fault injection for tests and drills: make a layer emit NaN/Inf, as a broken
FP16 kernel or an overflow would, to prove the guard and the FP32 fallback work."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


@dataclass
class _Hook:
    """A forward hook attached to one module; `remove()` detaches it."""

    handles: list[RemovableHandle] = field(default_factory=list, kw_only=True)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


@dataclass
class FaultInjector(_Hook):
    """Forward hook that overwrites part of a module's output with `value`.

    `every`: fire on every n-th call (1 = always); `fraction`: share of each
    output's last axis (from its start) that is overwritten; `rows`: only these batch
    rows (None: all); `limit`: fire at most this often (0: no limit)."""

    value: float = float("nan")
    every: int = 1
    fraction: float = 0.25
    rows: tuple[int, ...] | None = None
    limit: int = 0
    calls: int = 0
    fired: int = 0

    def __call__(self, module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls % self.every or (self.limit and self.fired >= self.limit):
            return output
        self.fired += 1
        out = output.clone()
        width = max(1, int(out.shape[-1] * self.fraction))
        if self.rows is None:
            out[..., :width] = self.value
        else:
            for row in self.rows:
                if row < out.shape[0]:
                    out[row, ..., :width] = self.value
        return out


def inject_nonfinite(
    model: nn.Module, module_name: str, value: float = float("nan"), every: int = 1, fraction: float = 0.25,
    rows: tuple[int, ...] | None = None, limit: int = 0,
) -> FaultInjector:
    """Attach a FaultInjector to `model.<module_name>`; call .remove() to undo."""
    try:
        module = model.get_submodule(module_name)
    except AttributeError as exc:
        raise ValueError(f"no module {module_name!r} to inject a fault into") from exc
    injector = FaultInjector(value=value, every=every, fraction=fraction, rows=rows, limit=limit)
    injector.handles.append(module.register_forward_hook(injector))
    return injector


@dataclass
class StepBreaker(_Hook):
    """Forward hook that raises, as a kernel error or an out-of-memory would, for batches of
    at least `min_rows` rows (to prove a failing batch is split and retried)."""

    min_rows: int = 2
    raised: int = 0

    def __call__(self, module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        if output.shape[0] >= self.min_rows:
            self.raised += 1
            raise RuntimeError(f"injected failure for a batch of {output.shape[0]} rows")
        return output


def break_batches(model: nn.Module, module_name: str, min_rows: int = 2) -> StepBreaker:
    """Attach a StepBreaker to `model.<module_name>`; call .remove() to undo."""
    breaker = StepBreaker(min_rows=min_rows)
    breaker.handles.append(model.get_submodule(module_name).register_forward_hook(breaker))
    return breaker
