"""The scripts a contributor runs (scripts/): each still starts and says how to use it.

Mostly --help runs here: the scripts themselves set up a venv, regenerate code, or drive a server for
minutes; gpu-bench's side-by-side mode runs once for real, on the CPU, with the smallest load. A
script added to scripts/ must be added here, which keeps that folder to what is tested."""

from __future__ import annotations

import json
import os
import shutil
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


def test_gpu_bench_serves_a_baseline_checkout_beside_this_one_and_loads_both(tmp_path: Path) -> None:
    """Two real servers on the CPU with the built-in voice: this checkout's, and a copy of its
    package as the --baseline, which that server runs; each run is made against both, which goes
    first alternating."""
    out, base = tmp_path / "out", (tmp_path / "base").resolve()
    shutil.copytree(SCRIPTS.parent / "service", base / "service", ignore=shutil.ignore_patterns("__pycache__"))
    argv = ["--device", "cpu", "--quick", "--runs", "single,single", "--precisions", "fp32",
            "--baseline", str(base), "--out", str(out), "--start-timeout", "600"]
    done = subprocess.run([sys.executable, str(SCRIPTS / "gpu-bench"), *argv], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert f"baseline: runs {base / 'service'}" in summary["notes"]
    assert f"runs {SCRIPTS.parent / 'service'}" in summary["notes"]
    rows = summary["rows"]
    assert [(r["run"], r["build"]) for r in rows] == [
        ("single-fp32", "this"), ("single-fp32-baseline", "baseline"),
        ("single-fp32-baseline-2", "baseline"), ("single-fp32-2", "this")]
    assert all(r["pass_rate"] == 1.0 and r["sessions"] == 1 for r in rows)
    assert (out / "serve-baseline.log").read_text() and (out / "metrics-baseline.txt").exists()
    assert f"baseline {base}" in (out / "gpu.txt").read_text()
