"""Acceptance: a new user's plain install. The wheel built from this tree goes into a clean
virtual environment without extras, and every user-facing subcommand's simplest form runs
from an empty temporary directory: each exits 0 (or with its documented usage error) and none
prints a traceback.

No network is used: the new environment gets its dependencies from this environment's installed
distributions, through a directory of links to exactly the runtime requirements of the wheel
(resolved transitively from installed metadata), so test-only packages (pytest, matplotlib,
pesq, ...) are not importable there, as after `pip install cadenza`.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import wave
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
TINY = DATA / "tiny-multi.onnx"
# The source the wheel is built from (what setuptools packages, plus what pyproject names).
SOURCES = ("pyproject.toml", "README.md", "service", "kernels")
# In [project.optional-dependencies] test only: must not be importable after a plain install.
TEST_ONLY_MODULES = ("pytest", "matplotlib", "pesq", "pocketsphinx", "kubernetes_validate", "yaml")
TIMEOUT_S = 120.0


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _runtime_requirements(wheel: Path) -> list[Requirement]:
    """Requires-Dist of the built wheel, without the extras."""
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(meta_name).decode("utf-8"))
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def _closure(reqs: list[Requirement]) -> dict[str, md.Distribution]:
    """The installed distributions that `reqs` need, transitively (no extras)."""
    found: dict[str, md.Distribution] = {}
    todo = list(reqs)
    while todo:
        req = todo.pop()
        key = _norm(req.name)
        if key in found:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            pytest.fail(f"runtime dependency {req} of the wheel is not installed in this environment")
        found[key] = dist
        for spec in dist.requires or []:
            sub = Requirement(spec)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                todo.append(sub)
    return found


def _link_site(dists: dict[str, md.Distribution], dest: Path) -> None:
    """A site directory of links to the files of `dists` (and of nothing else).

    A top-level entry used by these distributions alone is linked whole (keeping their
    __pycache__); one also used by another installed distribution (a namespace package such
    as `google/`) becomes a real directory with links one level down.
    """
    owners: dict[str, set[str]] = {}
    for dist in md.distributions():
        name = _norm(dist.metadata["Name"])
        for top in {f.parts[0] for f in dist.files or [] if f.parts}:
            owners.setdefault(top, set()).add(name)
    wanted: dict[Path, Path] = {}  # link -> target
    for key, dist in dists.items():
        files = dist.files
        assert files is not None, f"{key} has no RECORD: cannot tell its files"
        base = Path(str(dist.locate_file(""))).resolve()
        for f in files:
            if not f.parts or f.parts[0] in ("..", "__pycache__"):
                continue  # scripts outside site-packages; single-module caches are rebuilt
            top = f.parts[0]
            if owners.get(top, set()) <= set(dists) or len(f.parts) == 1:
                wanted[dest / top] = base / top
            else:
                wanted[dest / top / f.parts[1]] = base / top / f.parts[1]
    for link, target in sorted(wanted.items()):
        if target.exists() and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(target)


@dataclass
class FreshInstall:
    venv: Path
    env: dict[str, str]
    work: Path  # an empty working directory, outside the repository

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def cadenza(self) -> Path:
        return self.venv / "bin" / "cadenza"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FreshInstall]:
    base = tmp_path_factory.mktemp("fresh-install")
    # Build from a copy of the sources, so the repository's build/ and egg-info stay untouched.
    src = base / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    wheels = base / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index", "--no-build-isolation",
         "-w", str(wheels), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, f"building the wheel failed:\n{built.stdout}\n{built.stderr}"
    (wheel,) = wheels.glob("cadenza-*.whl")

    site = base / "deps"
    _link_site(_closure(_runtime_requirements(wheel)), site)

    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (venv_site,) = venv.glob("lib/python*/site-packages")
    # addsitedir (not a plain path line): the linked directory's own .pth files are processed too.
    (venv_site / "cadenza-deps.pth").write_text(f"import site; site.addsitedir({str(site)!r})\n", "utf-8")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
         "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert installed.returncode == 0, f"installing the wheel failed:\n{installed.stdout}\n{installed.stderr}"

    home = base / "home"
    work = base / "work"
    tmp = base / "tmp"
    for d in (home, work, tmp):
        d.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "CADENZA", "XDG_"))}
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", HOME=str(home),
        XDG_CACHE_HOME=str(home / ".cache"), VIRTUAL_ENV=str(venv), PYTHONUNBUFFERED="1", TMPDIR=str(tmp),
    )
    yield FreshInstall(venv=venv, env=env, work=work)


def test_plain_install_has_the_runtime_and_not_the_test_extras(fresh: FreshInstall) -> None:
    probe = (
        "import importlib.metadata as md, importlib.util as u, service\n"
        "from packaging.requirements import Requirement\n"
        "print('service', service.__file__)\n"
        "for r in map(Requirement, md.requires('cadenza')):\n"
        "    if r.marker is None or r.marker.evaluate({'extra': ''}):\n"
        "        v = md.version(r.name)\n"
        "        print('dep', r.name, v, r.specifier.contains(v, prereleases=True))\n"
        f"print('test-only', [m for m in {TEST_ONLY_MODULES!r} if u.find_spec(m)])\n"
    )
    done = subprocess.run([str(fresh.python), "-c", probe], cwd=fresh.work, env=fresh.env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    service_file = next(ln for ln in lines if ln.startswith("service "))
    assert str(fresh.venv) in service_file and str(ROOT) not in service_file, service_file
    deps = [ln.split() for ln in lines if ln.startswith("dep ")]
    assert len(deps) >= 10
    assert all(ok == "True" for *_, ok in deps), deps
    assert lines[-1] == "test-only []", lines[-1]
    # And for certain: the plotting library really is missing.
    mpl = subprocess.run([str(fresh.python), "-c", "import matplotlib"], cwd=fresh.work, env=fresh.env,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert mpl.returncode != 0 and "ModuleNotFoundError" in mpl.stderr


@dataclass
class Ran:
    args: list[str]
    returncode: int | None
    output: str
    seconds: float

    def problem(self, expect: tuple[int, ...] = (0,)) -> str | None:
        """What is wrong with this run, or None."""
        shown = " ".join(self.args)
        tail = "\n    ".join(self.output.strip().splitlines()[-25:])
        if self.returncode is None:
            return f"`cadenza {shown}` timed out after {self.seconds:.0f} s:\n    {tail}"
        if "Traceback" in self.output:
            return f"`cadenza {shown}` printed a traceback (exit {self.returncode}):\n    {tail}"
        if self.returncode not in expect:
            return f"`cadenza {shown}` exited {self.returncode}, expected {expect}:\n    {tail}"
        return None


def _run(fresh: FreshInstall, *args: str, timeout: float = TIMEOUT_S) -> Ran:
    start = time.monotonic()
    try:
        done = subprocess.run([str(fresh.cadenza), *args], cwd=fresh.work, env=fresh.env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else (exc.output or "")
        ran = Ran(list(args), None, out, time.monotonic() - start)
    else:
        ran = Ran(list(args), done.returncode, done.stdout, time.monotonic() - start)
    print(f"{ran.seconds:6.1f} s  exit {ran.returncode}  cadenza {' '.join(args)}")
    return ran


def _wav_frames(path: Path) -> int:
    with wave.open(str(path)) as w:
        return w.getnframes()


def _serve_and_client(fresh: FreshInstall) -> list[str]:
    """`cadenza serve` on a free port with the tiny voice, `cadenza client` against it, SIGTERM."""
    problems: list[str] = []
    serve_args = ["serve", "--host", "127.0.0.1", "--port", "0", "--voices", str(DATA), "--voice", "tiny-multi",
                  "--threads", "1"]
    server = subprocess.Popen([str(fresh.cadenza), *serve_args], cwd=fresh.work, env=fresh.env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()
    port: list[int] = []

    def read() -> None:
        assert server.stdout is not None
        for line in server.stdout:
            lines.append(line)
            if not port and (m := re.search(r"serving on \S+:(\d+)\s*$", line)):
                port.append(int(m.group(1)))
                ready.set()
        ready.set()  # EOF: the server ended

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not ready.wait(TIMEOUT_S) or not port:
            tail = "\n    ".join("".join(lines).strip().splitlines()[-25:])
            return [f"`cadenza {' '.join(serve_args)}` printed no 'serving on HOST:PORT' line "
                    f"(exit {server.poll()}):\n    {tail}"]
        addr = f"127.0.0.1:{port[0]}"
        client = _run(fresh, "client", "Hello.", "-o", "x.wav", "--addr", addr)
        if (p := client.problem()) is not None:
            problems.append(p)
        elif not (fresh.work / "x.wav").is_file() or _wav_frames(fresh.work / "x.wav") == 0:
            problems.append(f"`cadenza client` wrote no audio to x.wav:\n    {client.output}")
        load = _run(fresh, "bench", "load", "--target", addr, "--sessions", "1")
        if (p := load.problem()) is not None:
            problems.append(p)
        elif "pass_rate=" not in load.output:
            problems.append(f"`cadenza bench load` printed no pass_rate= line:\n    {load.output}")
        server.send_signal(signal.SIGTERM)
        try:
            code: int | None = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
        reader.join(timeout=10)
        ran = Ran(serve_args, code, "".join(lines), 0.0)
        if (p := ran.problem()) is not None:
            problems.append(p.replace("timed out after 0 s", "did not exit within 60 s of SIGTERM"))
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return problems


def test_every_subcommand_from_a_temporary_directory(fresh: FreshInstall) -> None:
    tiny = str(TINY)
    problems: list[str] = []

    # First `say`: it exports the tiny voice's stages into the (empty) cache the later commands share.
    say = _run(fresh, "say", "Hi.", "-o", "out.wav", "--voice", tiny)
    if (p := say.problem()) is not None:
        problems.append(p)
    elif _wav_frames(fresh.work / "out.wav") == 0:
        problems.append(f"`cadenza say` wrote an empty out.wav:\n    {say.output}")

    # The rest is independent: two at a time (the serve/client round trip is one job).
    simple: list[tuple[list[str], tuple[int, ...], str | None]] = [
        # (arguments, accepted exit codes, text the output must contain)
        (["--version"], (0,), "0.1.0"),
        (["--help"], (0,), "usage: cadenza"),
        (["voices", "list"], (0,), "en_US-joe-medium"),
        (["voices", "check", "--voice", tiny], (0,), "min_psnr_db="),
        # A real `voices install kokoro` is tests/models/kokoro's (it fetches ~120 MB once).
        (["voices", "install", "--help"], (0,), "usage: cadenza voices install"),
        (["compare", "--help"], (0,), "usage: cadenza compare"),
        # No matplotlib here: the JSON report and the min_psnr_db= line must still come out.
        (["compare", "--voice", tiny, "--limit", "1"], (0,), "min_psnr_db="),
        (["precision", "sensitivity", "--help"], (0,), "usage: cadenza precision sensitivity"),
        (["precision", "sensitivity", "--voice", tiny, "--limit", "1"], (0,), "dec.conv_post"),
        (["bench", "cpu", "--help"], (0,), "usage: cadenza bench cpu"),  # a real run takes a minute
        (["bench", "load", "--help"], (0,), "usage: cadenza bench load"),  # run for real against `serve` below
        (["bench", "streams", "--help"], (0,), "usage: cadenza bench streams"),
        (["bench", "streams", "--streams", "1", "--backend", "torch"], (0,), "1/1"),
        # A usage error: exit 2 with argparse's one-line message, no traceback.
        (["no-such-command"], (2,), "invalid choice"),
    ]
    with ThreadPoolExecutor(2) as pool:
        round_trip = pool.submit(_serve_and_client, fresh)
        runs = [(pool.submit(_run, fresh, *args), expect, needle) for args, expect, needle in simple]
        for future, expect, needle in runs:
            ran = future.result()
            if (p := ran.problem(expect)) is not None:
                problems.append(p)
            elif needle and needle not in ran.output:
                problems.append(f"`cadenza {' '.join(ran.args)}` did not print {needle!r}:\n    {ran.output[-2000:]}")
        problems.extend(round_trip.result())

    assert not problems, "\n\n".join(problems)
    # Nothing was written outside the working directory's named outputs.
    assert sorted(p.name for p in fresh.work.iterdir()) == ["out.wav", "x.wav"]
