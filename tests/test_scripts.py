"""The scripts a contributor runs (scripts/): each still starts and says how to use it.

Only --help runs here: the scripts themselves set up a venv, regenerate code, or drive a server for
minutes. A script added to scripts/ must be added here, which keeps that folder to what is tested."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
KEPT = ("dev-setup", "gen_protos", "gpu-bench", "make_cosyvoice2_checkpoint.py", "make_test_voice.py", "soak")


def test_scripts_holds_only_the_tested_scripts() -> None:
    assert sorted(p.name for p in SCRIPTS.iterdir() if p.name != "__pycache__") == sorted(KEPT)


def _argv(script: Path) -> list[str]:
    """Python scripts run under this interpreter (the one with the package); the others as they are."""
    shebang = script.read_text().splitlines()[0]
    return [sys.executable, str(script)] if "python" in shebang or script.suffix == ".py" else [str(script)]


@pytest.mark.parametrize("name", KEPT)
def test_script_help(name: str) -> None:
    script = SCRIPTS / name
    # PYTHON: the interpreter the shell scripts use (soak); dev-setup exits on --help before touching the venv.
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run([*_argv(script), "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:"), done.stdout
    assert "Traceback" not in done.stderr


def test_dev_setup_parses_and_refuses_arguments() -> None:
    script = SCRIPTS / "dev-setup"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    done = subprocess.run([str(script), "--bogus"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and done.stderr.startswith("usage:")


def test_scripts_run_by_name_are_executable() -> None:
    for name in KEPT:
        if not name.endswith(".py"):
            assert os.access(SCRIPTS / name, os.X_OK), f"scripts/{name} is not executable"
