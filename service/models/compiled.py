"""torch.compile for a family's hot modules, and where Cadenza keeps what it makes on disk."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)
R = TypeVar("R")
T = TypeVar("T")


def cache_home() -> Path:
    """Cadenza's own cache: $XDG_CACHE_HOME or ~/.cache, /cadenza (never raises for a user without
    a home: an unusable path falls back later, see stage_export.writable_cache_dir)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cadenza"


def keep_compiled_kernels() -> None:
    """inductor keeps what it compiled under /tmp by default, so a new machine or a cleared /tmp
    compiles again at start-up: keep it under Cadenza's cache home instead (`cache_home()`). A
    TORCHINDUCTOR_CACHE_DIR the user set wins (the Helm chart sets it to its volume)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_home() / "inductor"))


class CompiledOrEager(Generic[R]):
    """`fn` through torch.compile (dynamic shapes: one compile serves every bucket) when
    `compiled`, else as it is. Compiling happens at the first call, often a CUDA graph's warm-up
    run, so a compiler that fails shows there: `fall_back` then runs `fn` eagerly from then on,
    with a warning naming `what`, and `retry_eager` wraps that around a call."""

    def __init__(self, fn: Callable[..., R], what: str, compiled: bool) -> None:
        self.eager, self.what = fn, what
        self._fn: Callable[..., R] = fn
        if compiled:
            import torch

            keep_compiled_kernels()
            self._fn = torch.compile(fn, dynamic=True)

    @property
    def compiled(self) -> bool:
        return self._fn is not self.eager

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        return self._fn(*args, **kwargs)

    def fall_back(self, exc: Exception) -> None:
        """Eager from now on after `exc`; re-raises it when already eager (nothing to fall back to)."""
        if not self.compiled:
            raise exc
        log.warning("compiling %s failed (%s: %s); it runs eager kernels", self.what, type(exc).__name__, exc)
        self._fn = self.eager

    def retry_eager(self, call: Callable[[], T]) -> T:
        """`call()`, or, where it fails while compiled, `call()` again after `fall_back`."""
        try:
            return call()
        except Exception as exc:
            self.fall_back(exc)
            return call()
