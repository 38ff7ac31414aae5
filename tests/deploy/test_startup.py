"""Start-up for a pod: ONNX exports from a read-only prebuilt dir or a writable cache (an
unwritable one falls back, never crashes), every voice warm before SERVING, `cadenza health`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.api.server import ServerConfig
from service.engine.config import EngineConfig
from service.models.vits.backends.stage_export import STAGES, cached_stage_exports, export_dir_name
from service.models.vits.voice import Voice
from service.voices import find_voice
from tests.api.native_server import ServerThread

DATA = Path(__file__).resolve().parents[1] / "data"
TINY = DATA / "tiny-multi.onnx"


@pytest.fixture(scope="module")
def tiny() -> Voice:
    return Voice(find_voice("tiny-multi", DATA))


@pytest.fixture()
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The process's temporary directory, private to the test."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(root))
    return root


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*") if p.is_file()}


def test_unwritable_cache_falls_back_to_a_temp_dir_with_a_warning(
    tiny: Voice, tmp_path: Path, temp_root: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the cache should be")  # was NotADirectoryError, a crash
    with caplog.at_level(logging.WARNING, logger="service.models.vits.backends.stage_export"):
        paths = cached_stage_exports(tiny.model, TINY, blocked / "onnx", prebuilt=())
    assert all(p.is_file() and p.is_relative_to(temp_root) for p in paths.values())
    assert set(STAGES) <= set(paths)
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert str(blocked / "onnx") in warning and str(temp_root) in warning and "--cache-dir" in warning
    # The next start finds them in the fallback without exporting again.
    again = cached_stage_exports(tiny.model, TINY, blocked / "onnx", prebuilt=())
    assert again == paths and all(p.stat().st_mtime == again[k].stat().st_mtime for k, p in paths.items())


def test_the_first_export_promises_no_time_and_reports_the_time_it_took(
    tiny: Voice, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """How long an export takes depends on the machine and the voice: the line before it says
    only that it happens once; the line after it gives the measured time."""
    import re

    with caplog.at_level(logging.INFO, logger="service.models.vits.backends.stage_export"):
        cached_stage_exports(tiny.model, TINY, tmp_path / "onnx", prebuilt=())
    before, after = (r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert before.startswith("exporting ONNX stages for voice tiny-multi") and "once" in before
    assert not re.search(r"\d", before.replace(str(tmp_path / "onnx" / export_dir_name(TINY)), "")), before
    assert re.search(r" in \d+\.\d s ", after), after


def test_prebuilt_read_only_exports_are_used_before_the_cache(tiny: Voice, tmp_path: Path, temp_root: Path) -> None:
    prebuilt = tmp_path / "image"
    built = cached_stage_exports(tiny.model, TINY, prebuilt, prebuilt=())  # what the image build does
    assert built[STAGES[0]].parent == prebuilt / export_dir_name(TINY)
    for p in [prebuilt, *prebuilt.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    cache = tmp_path / "cache"
    try:
        found = cached_stage_exports(tiny.model, TINY, cache, prebuilt=(prebuilt,))
        assert found == built
        assert not cache.exists() and not files_under(temp_root)  # nothing written anywhere
    finally:
        for p in [prebuilt, *prebuilt.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)


def test_an_incomplete_prebuilt_dir_is_not_used(tiny: Voice, tmp_path: Path, temp_root: Path) -> None:
    prebuilt = tmp_path / "image"
    built = cached_stage_exports(tiny.model, TINY, prebuilt, prebuilt=())
    built["audio"].unlink()
    found = cached_stage_exports(tiny.model, TINY, tmp_path / "cache", prebuilt=(prebuilt,))
    assert all(p.is_relative_to(tmp_path / "cache") and p.is_file() for p in found.values())


def tiny_server(**engine: object) -> ServerConfig:
    base: dict[str, object] = dict(voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu", threads=1,
                                   cache_bytes=0)
    base.update(engine)
    return ServerConfig(host="127.0.0.1", port=0, engine=EngineConfig(**base))  # type: ignore[arg-type]


def health(addr: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "service.cli", "health", "--addr", addr, "--timeout", "5"],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_preload_warms_every_voice_before_serving_and_health_says_so(tmp_path: Path) -> None:
    """With preload, SERVING means every voice is loaded and warm (the built-in one too), and an
    unwritable cache dir does not stop the server."""
    blocked = tmp_path / "file"
    blocked.write_text("")
    server = ServerThread(tiny_server(preload=True, cache_dir=blocked))
    try:
        voices = {v.name: v.loaded for v in server.server.engine.voices()}
        assert len(voices) >= 2 and all(voices.values()), voices
        done = health(server.addr)
        assert done.returncode == 0 and done.stdout.strip() == f"{server.addr}: SERVING", done
    finally:
        server.close()


def test_without_preload_only_the_default_voice_is_loaded() -> None:
    server = ServerThread(tiny_server())
    try:
        voices = {v.name: v.loaded for v in server.server.engine.voices()}
        assert voices.pop("tiny-multi") is True and not any(voices.values()), voices
    finally:
        server.close()


def test_health_exits_non_zero_when_the_server_cannot_be_reached() -> None:
    done = health("127.0.0.1:1")
    assert done.returncode == 1 and "UNAVAILABLE" in done.stderr


def test_health_imports_no_torch() -> None:
    """A health check runs every few seconds in a container: it must stay light."""
    code = ("import sys; from service.cli import main\n"
            "try: main(['health', '--addr', '127.0.0.1:1', '--timeout', '0.2'])\n"
            "finally: print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.stdout.strip() == "False", out
