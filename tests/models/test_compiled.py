"""Where torch.compile's kernels are kept (`service.models.compiled`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.models.compiled import CompiledOrEager, keep_compiled_kernels


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


def test_a_compiler_that_fails_leaves_eager_kernels_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """`CompiledOrEager`: asked to compile, it compiles with dynamic shapes; a failure where the
    compiled function first runs (a graph's warm-up) is retried on the eager one, which serves
    from then on. Where nothing was compiled, the failure is the caller's: it is raised."""
    import torch

    asked: list[dict[str, object]] = []

    def failing_compile(fn: object, **options: object) -> object:
        asked.append(options)

        def fail(*args: object) -> int:
            raise RuntimeError("no compiler here")
        return fail

    monkeypatch.setattr(torch, "compile", failing_compile)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/srv/kernels")
    calls: list[int] = []

    def double(x: int) -> int:
        calls.append(x)
        return 2 * x

    stage = CompiledOrEager(double, "the test stage", compiled=True)
    assert stage.compiled and asked == [{"dynamic": True}]
    with caplog.at_level("WARNING"):
        assert stage.retry_eager(lambda: stage(3)) == 6
    assert "compiling the test stage failed (RuntimeError: no compiler here); it runs eager kernels" in caplog.text
    assert not stage.compiled and stage(4) == 8 and calls == [3, 4]

    eager = CompiledOrEager(lambda x: 1 // x, "the eager stage", compiled=False)
    assert not eager.compiled and len(asked) == 1
    with pytest.raises(ZeroDivisionError):
        eager.retry_eager(lambda: eager(0))
