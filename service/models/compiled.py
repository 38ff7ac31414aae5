"""torch.compile for a family's hot modules, and where Cadenza keeps what it makes on disk."""

from __future__ import annotations

import os
from pathlib import Path


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
