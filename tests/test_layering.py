"""Imports flow one way (README "How it works"): nothing low imports something high, so the
engine never depends on a tool, nor a model on the engine."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Higher layers may import lower ones, never the reverse.
LAYERS = {
    "cli": 7,
    "tools": 6,
    "api": 5,
    "engine": 4,
    "models": 3, "voices": 3,
    "text": 1, "audio": 1, "telemetry": 1,
    "kernels": 0,
}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "kernels":
        return "kernels"
    if parts[0] == "service" and len(parts) > 1:
        return parts[1]
    return None


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_imports_flow_one_way() -> None:
    files = [p for p in [*ROOT.joinpath("service").rglob("*.py"), *ROOT.joinpath("kernels").rglob("*.py")]
             if "gen" not in p.relative_to(ROOT).parts]
    unknown, wrong = set(), []
    for path in files:
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) <= 2:
            continue  # the package roots
        source = _layer(".".join(parts))
        if source not in LAYERS:
            unknown.add(source)
            continue
        for name in _imports(path):
            target = _layer(name)
            if target is None or target == source:
                continue
            if target not in LAYERS:
                unknown.add(target)
            elif LAYERS[target] > LAYERS[source]:
                wrong.append(f"{path.relative_to(ROOT)} ({source}) imports {name} ({target})")
    assert not unknown, f"modules in no layer: {sorted(map(str, unknown))}; add them to LAYERS"
    assert not wrong, "\n".join(wrong)


def test_the_engine_and_the_api_see_models_only_through_the_family_contract() -> None:
    """service/engine and service/api import nothing of a model family's own (service.models.vits):
    what they need of a model is in service.models.family, and the registry finds the family."""
    wrong = []
    for package in ("engine", "api"):
        for path in ROOT.joinpath("service", package).rglob("*.py"):
            if "gen" in path.relative_to(ROOT).parts:
                continue
            for name in _imports(path):
                if name.startswith("service.models.") and name not in ("service.models.family",
                                                                       "service.models.registry"):
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(wrong)


# A model family's own words (VITS's tensors, modules and noise scales): the engine and the API
# speak of decoder input, frames and family options instead.
FAMILY_WORDS = re.compile(r"(?<![\w-])(z_p|m_p|logs_p|noise_w|noise_scale|flow|flows|dec|halo|halos|flow_halo|"
                          r"voc_halo|vocoder|vits)(?![\w-])", re.IGNORECASE)


def test_the_engine_and_the_api_name_no_family_internals() -> None:
    found = []
    for package in ("engine", "api"):
        for path in ROOT.joinpath("service", package).rglob("*.py"):
            if "gen" in path.relative_to(ROOT).parts:
                continue
            for number, line in enumerate(path.read_text("utf-8").splitlines(), 1):
                if match := FAMILY_WORDS.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r} in {line.strip()}")
    assert not found, "\n".join(found)


def test_the_engine_probes_no_backend_for_methods() -> None:
    """Capabilities are declared (`service.models.family.Capabilities`), never discovered."""
    found = []
    for package in ("engine", "api"):
        for path in ROOT.joinpath("service", package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text("utf-8"))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: hasattr")
    assert not found, "\n".join(found)
