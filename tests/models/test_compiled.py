"""Where torch.compile's kernels are kept (`service.models.compiled`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.models.compiled import keep_compiled_kernels


def test_compiled_kernels_are_kept_in_cadenzas_cache_unless_the_user_says_where(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """inductor's default home is /tmp (gone with the machine): a compiled stage keeps its kernels
    under Cadenza's cache, and a TORCHINDUCTOR_CACHE_DIR set by the user stays."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    keep_compiled_kernels()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cadenza" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/srv/kernels")
    keep_compiled_kernels()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/srv/kernels"
