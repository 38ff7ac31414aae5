"""The deployment tools the chart and image tests run: real helm, kubernetes-validate, hadolint and
checkov. `.ci/run` provides them (cached under .tools/ and the venv) and sets
CADENZA_REQUIRE_DEPLOY_TOOLS=1, so in CI a missing tool fails the test instead of skipping it."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# Where .ci/run puts what is not a project dependency (see there).
CANDIDATES = {
    "helm": [ROOT / ".tools" / "helm" / "helm"],
    "kubernetes-validate": [VENV_BIN / "kubernetes-validate"],
    "hadolint": [VENV_BIN / "hadolint"],
    "checkov": [ROOT / ".tools" / "checkov-venv" / "bin" / "checkov"],
}


def tool(name: str) -> str:
    """The tool's path: the project's own copy first, then PATH; else fail (CI) or skip."""
    for path in CANDIDATES.get(name, []):
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which(name)
    if found:
        return found
    message = f"{name} is not installed (.ci/run installs it: {', '.join(map(str, CANDIDATES.get(name, [])))})"
    if os.environ.get("CADENZA_REQUIRE_DEPLOY_TOOLS"):
        pytest.fail(message)
    pytest.skip(message)
