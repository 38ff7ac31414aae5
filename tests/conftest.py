"""Project-wide test setup: tests marked `gpu` skip cleanly where torch sees no CUDA GPU."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from service.models.family import VoiceRuntime


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests, with the reason, when no CUDA device is available."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TESTS_DIR = Path(__file__).parent
TINY_VOICE = TESTS_DIR / "data" / "tiny-multi.onnx"


@pytest.fixture(scope="session")
def tiny_voice_path() -> Path:
    """The committed tiny multi-speaker voice (scripts/make_test_voice.py)."""
    return TINY_VOICE


@pytest.fixture(scope="session")
def onnx_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Stage exports for this test session only."""
    return str(tmp_path_factory.mktemp("onnx-cache"))


@pytest.fixture(scope="session")
def builtin_ort(onnx_cache_dir: str) -> VoiceRuntime:
    """The built-in voice on ONNX Runtime (the CPU default), loaded once."""
    from pathlib import Path

    from service.models.registry import open_voice
    from service.voices import builtin_voice_info

    return open_voice(builtin_voice_info(), "onnxruntime", "cpu", cache_dir=Path(onnx_cache_dir))


@pytest.fixture(scope="session")
def cosyvoice2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight CosyVoice2 directory in the official layout, small shapes
    (scripts/make_cosyvoice2_checkpoint.py), alone in its parent folder (a --voices folder).
    Where the official tree is not installed (the GPU image) the weights are drawn with our own
    modules: the tests that compare with upstream need the tree anyway."""
    import importlib.util
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("cosyvoice2") / "CosyVoice2-test"
    script = TESTS_DIR.parent / "scripts" / "make_cosyvoice2_checkpoint.py"
    weights = "official" if importlib.util.find_spec("cosyvoice") is not None else "own"
    subprocess.run([sys.executable, str(script), str(out), "--size", "small", "--seed", "3", "--weights", weights],
                   check=True, capture_output=True, text=True)
    return out
