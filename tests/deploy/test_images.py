"""The Dockerfiles: hadolint-clean, layers ordered for caching, the paths the code reads
(prebuilt exports, prebuilt guard kernel) are the ones the images fill, every `cadenza` command
line in them parses with the real CLI, and the GPU image's kernel stage compiles guard.cu for
every architecture it names (real nvcc)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from kernels.loader import GUARD_PREBUILT
from service.cli import build_parser
from service.models.vits.backends.stage_export import PREBUILT_DIR
from tests.deploy.tools import ROOT, tool

CPU = ROOT / "Dockerfile"
GPU = ROOT / "Dockerfile.gpu"
BOTH = pytest.mark.parametrize("dockerfile", [CPU, GPU], ids=lambda p: p.name)


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n(\s*#[^\n]*\n)*", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages(dockerfile: Path) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(dockerfile):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


@BOTH
def test_hadolint_passes(dockerfile: Path) -> None:
    done = subprocess.run([tool("hadolint"), "--no-color", str(dockerfile)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


@BOTH
def test_runtime_stage_is_non_root_with_a_grpc_health_check(dockerfile: Path) -> None:
    final = stages(dockerfile)[-1]
    user = [args for word, args in final if word == "USER"]
    assert user and re.fullmatch(r"[1-9][0-9]*:[1-9][0-9]*", user[-1]), user  # numeric: runAsNonRoot can check it
    check = next(args for word, args in final if word == "HEALTHCHECK")
    command = json.loads(check.split("CMD", 1)[1])
    assert command[:2] == ["cadenza", "health"]
    assert build_parser().parse_args(command[1:]).func.__name__ == "_cmd_health"
    cmd = json.loads(next(args for word, args in final if word == "CMD"))
    entry = json.loads(next(args for word, args in final if word == "ENTRYPOINT"))
    assert entry == ["cadenza"] and build_parser().parse_args(cmd).func.__name__ == "_cmd_serve"
    # What the code reads from fixed paths is what the image puts there.
    copies = " ".join(args for word, args in final if word == "COPY")
    assert str(PREBUILT_DIR) in copies
    if dockerfile is GPU:
        assert f"/src/guard.fatbin {GUARD_PREBUILT}" in copies


@BOTH
def test_exports_are_prebuilt_where_the_server_looks_first(dockerfile: Path) -> None:
    runs = [args for word, args in instructions(dockerfile) if word == "RUN" and "cadenza say" in args]
    assert len(runs) == 1
    say = shlex.split(runs[0].split("&&")[0])
    parsed = build_parser().parse_args(say[1:])
    assert parsed.func.__name__ == "_cmd_say" and parsed.cache_dir == str(PREBUILT_DIR)


@BOTH
def test_a_code_change_reuses_the_torch_and_dependency_layers(dockerfile: Path) -> None:
    build = next(s for s in stages(dockerfile) if "torch==" in " ".join(args for _, args in s))
    order = [(word, args) for word, args in build if word in ("RUN", "COPY")]
    torch = next(i for i, (w, a) in enumerate(order) if w == "RUN" and "torch==" in a)
    code = next(i for i, (w, a) in enumerate(order) if w == "COPY" and a.startswith("service"))
    # The dependency layer carries the kokoro extra: the chart serves Kokoro voices (voices.kokoro).
    deps = next(i for i, (w, a) in enumerate(order) if w == "RUN" and 'pip install ".[kokoro]"' in a)
    copies_before_code = [a for w, a in order[:code] if w == "COPY"]
    assert torch < deps < code
    assert copies_before_code == ["pyproject.toml README.md ./"]  # nothing that changes with the code
    assert "download.pytorch.org/whl/" + ("cpu" if dockerfile is CPU else "${TORCH_CUDA}") in order[torch][1]


def test_dockerignore_keeps_the_context_to_what_the_images_copy() -> None:
    lines = [x for x in (ROOT / ".dockerignore").read_text().splitlines() if x and not x.startswith("#")]
    assert lines[0] == "*"
    sources = {src for d in (CPU, GPU) for w, a in instructions(d) if w == "COPY" and "--from" not in a
               for src in a.split()[:-1]}
    assert sources >= {"pyproject.toml", "README.md", "service", "kernels"}
    for src in sources:
        top = src.split("/")[0]
        assert f"!{top}" in lines or f"!{top}/" in lines, src


def test_the_gpu_kernel_stage_compiles_the_guard_for_every_architecture(tmp_path: Path) -> None:
    """The `kernels` stage's own RUN line, run here with real nvcc."""
    kernel_stage = next(s for s in stages(GPU) if "AS kernels" in s[0][1])
    archs = next(a for w, a in kernel_stage if w == "ARG" and a.startswith("CUDA_ARCHS="))
    script = next(a for w, a in kernel_stage if w == "RUN")
    script = script.split("&& cuobjdump")[0]  # listing tool of the devel image; checked below instead
    (tmp_path / "guard.cu").write_text((ROOT / "kernels" / "guard.cu").read_text())
    nvcc_dir = str(Path(tool("nvcc")).parent)
    done = subprocess.run(["bash", "-o", "pipefail", "-c", f"export {archs}; {script}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600,
                          env={"PATH": f"{nvcc_dir}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    blob = (tmp_path / "guard.fatbin").read_bytes()
    for arch in json.loads(json.dumps(archs.split("=", 1)[1].strip('"').split())):
        assert f"-arch sm_{arch} ".encode() in blob, arch  # a cubin per architecture
    for kernel in (b"guard_f16", b"guard_f32"):  # the names loader.py looks up
        assert kernel in blob
