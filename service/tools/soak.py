"""Bounded reliability runs against a REAL local server: stalled readers, fairness, cancel storm, soak.

`scripts/soak` (or `python -m service.tools.soak`) starts `cadenza serve --port 0` on loopback itself, waits for
it to be SERVING, drives it over the native gRPC API through four scenarios, stops it with SIGTERM and checks
that it exits cleanly. Every scenario stops by itself; `--short` is the CI size (well under a minute with the
tiny test voice), the default is the long variant. One result line per scenario, then a `soak:` verdict line.

a) stalled  3 sessions send a long text and never read; the server's peak RSS over the window is compared with
            its RSS before (the engine holds back a session with --max-ahead seconds of unread audio, so it must
            stay bounded whatever the text length); then they are cancelled and RSS must not keep growing.
b) fair     one session sends a 5 000-character text at once; 0.5 s later a short one starts; both read at
            real-time pace (a player that keeps PLAYER_BUFFER_S buffered). TTFA and worst stall (how late a chunk
            came against when its audio was due to play) for both.
c) storm    many sessions opened and cancelled quickly, alongside 2 healthy sessions whose audio is verified
            complete (summary present; samples equal summary audio_seconds x rate within one chunk; contiguous).
d) soak     M concurrent sessions speak several sentences again and again for T seconds, each verified.
e) memory   after a warm-up, N sessions of C characters each at once, read in full; the engine core's RSS
            once they have all ended must come back within a bound of its RSS after the warm-up (memory that
            is only held, not used, is given back).

After each scenario an `rss:` line gives every process of the server: the API server(s), the engine core
and its frontend workers (found as the server's descendants in /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc

from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.engine.memory import CORE_PROCESS_NAME
from service.tools.bench_load import SENTENCES, wait_until_serving, worst_underrun

ROOT = Path(__file__).resolve().parents[2]
TINY_VOICE = ROOT / "tests" / "data" / "tiny-multi.onnx"
SHORT_TEXT = "Hello, how can I help you today?"
PLAYER_BUFFER_S = 0.5  # a real-time reader takes the next chunk when less than this much audio is left to play
SERVER_START_TIMEOUT_S = 180.0
SESSION_TIMEOUT_S = 300.0
TEXT_PIECE_CHARS = 2000  # long texts go out in pieces of this size (one gRPC message each)


@dataclass(frozen=True)
class SoakConfig:
    """Sizes of each scenario. `short()` is the CI variant, the defaults the long one."""

    stall_sessions: int = 3
    stall_chars: int = 20_000
    stall_window_s: float = 20.0
    fair_long_chars: int = 5_000
    fair_delay_s: float = 0.5
    fair_long_window_s: float = 20.0  # the long session is read this long (at real time), then cancelled
    storm_sessions: int = 50
    storm_s: float = 30.0
    soak_sessions: int = 12
    soak_s: float = 120.0
    memory_sessions: int = 20
    memory_chars: int = 20_000
    memory_warm_chars: int = 3_000  # per session in the warm-up (as many at once as the load)
    # Once the sessions have ended, the core must give back at least this share of what they added to its RSS
    # above the post-warm-up level, or keep no more than memory_kept_mb above it (the first long texts size
    # some of its buffers for good: a repeat of the load adds nothing more)...
    memory_kept_share: float = 0.5
    memory_kept_mb: float = 64.0
    memory_settle_s: float = 5.0  # ... measured this long after the last one ended (the core trims when idle)
    scenarios: tuple[str, ...] = ("stalled", "fair", "storm", "soak", "memory")

    @classmethod
    def short(cls) -> SoakConfig:
        return cls(stall_window_s=6.0, fair_long_window_s=6.0, storm_sessions=10, storm_s=8.0, soak_sessions=4,
                   soak_s=20.0, memory_sessions=6, memory_chars=3_000, memory_warm_chars=1_000)


@dataclass
class Result:
    """One scenario's figures; `failures` empty when it passed its own checks."""

    name: str
    figures: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def line(self) -> str:
        parts = " ".join(f"{k}={_fmt(v)}" for k, v in self.figures.items())
        verdict = "ok" if not self.failures else "FAIL: " + "; ".join(self.failures)
        return f"{self.name}: {parts} -> {verdict}"


@dataclass
class SoakReport:
    results: dict[str, Result]
    exit_code: int | None  # the server's, after SIGTERM
    server: str  # backend/device/voice as GetServerInfo says
    log_errors: int = 0  # ERROR lines in the server's log (the CI test requires none)

    @property
    def passed(self) -> bool:
        return self.exit_code == 0 and all(not r.failures for r in self.results.values())


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.1f}"
    return str(v)


def long_text(chars: int, seed: int = 0) -> str:
    """About `chars` characters of whole sentences (at least one)."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < chars or not out:
        s = rng.choice(SENTENCES)
        out.append(s)
        size += len(s) + 1
    return " ".join(out)


# ---- the server process ---------------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (/proc/<pid>/status VmRSS); 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def server_processes(root: int) -> dict[str, list[int]]:
    """The server's processes by kind: "api" (the server and its other API server processes), "core" (the
    engine core) and "frontend" (the core's frontend workers); multiprocessing's resource trackers are left out.
    Descendants are found by their parent pid in /proc/<pid>/stat."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _read(f"/proc/{entry.name}/stat")
            fields = stat[stat.rfind(")") + 2:].split()
            if len(fields) > 1:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    kinds: dict[str, list[int]] = {"api": [], "core": [], "frontend": []}

    def visit(pid: int, under_core: bool) -> None:
        if "resource_tracker" in _read(f"/proc/{pid}/cmdline"):
            return
        is_core = _read(f"/proc/{pid}/comm").strip() == CORE_PROCESS_NAME
        kinds["core" if is_core else "frontend" if under_core else "api"].append(pid)
        for child in sorted(children.get(pid, [])):
            visit(child, under_core or is_core)

    visit(root, False)
    return kinds


def rss_by_kind(processes: dict[str, list[int]]) -> dict[str, int]:
    """Summed RSS of each kind of `server_processes`."""
    return {kind: sum(rss_bytes(pid) for pid in pids) for kind, pids in processes.items()}


class LocalServer:
    """`python -m service.cli serve --port 0` on loopback, its stdout parsed for `serving on HOST:PORT`."""

    def __init__(self, args: Sequence[str], log: IO[bytes]) -> None:
        cmd = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
        self.address: str | None = None
        self._found = threading.Event()
        self._lines: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.append(line.rstrip())
            m = re.search(r"serving on (\S+):(\d+)", line)
            if m and self.address is None:
                self.address = f"{m.group(1)}:{m.group(2)}"
                self._found.set()
        self._found.set()  # stdout closed: the process ended

    def wait_address(self, timeout_s: float = SERVER_START_TIMEOUT_S) -> str:
        self._found.wait(timeout_s)
        if self.address is None:
            self.stop(5.0)
            raise RuntimeError(f"the server did not print its address (exit {self.proc.poll()}); "
                               f"stdout: {self._lines[-5:]}")
        return self.address

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def processes(self) -> dict[str, list[int]]:
        return server_processes(self.proc.pid)

    def rss_line(self) -> str:
        """Every process's RSS in MB, by kind: `rss: api=412 core=655 frontend=88+87`."""
        parts = []
        for kind, pids in self.processes().items():
            sizes = [rss_bytes(pid) / MB for pid in pids]
            parts.append(f"{kind}=" + ("+".join(f"{v:.0f}" for v in sizes) or "-"))
        return "rss: " + " ".join(parts)

    def stop(self, timeout_s: float = 40.0) -> int | None:
        """SIGTERM, wait; SIGKILL when it does not end. The exit code (None if it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                return None
        return self.proc.returncode


class RssSampler:
    """Polls the server's RSS every `period_s` while running; `peak` since start(), `peaks` by kind of process."""

    def __init__(self, server: LocalServer, period_s: float = 0.05) -> None:
        self.server, self.period_s = server, period_s
        self.peak = 0
        self.peaks: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def _sample(self) -> None:
        self.peak = max(self.peak, self.server.rss())
        for kind, rss in rss_by_kind(self._processes).items():
            self.peaks[kind] = max(self.peaks.get(kind, 0), rss)

    async def _run(self) -> None:
        while True:
            self._sample()
            await asyncio.sleep(self.period_s)

    def start(self) -> None:
        self._processes = self.server.processes()  # found once: a /proc scan per sample would be most of the cost
        self.peak, self.peaks = 0, {}
        self._sample()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> int:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sample()
        return self.peak


MB = 1 << 20


# ---- client sessions ------------------------------------------------------------------------------------------


async def _requests(text: str, marks: dict[str, float], request_id: str, end: bool = True
                    ) -> AsyncIterator[pb.StreamingSynthesizeRequest]:
    yield pb.StreamingSynthesizeRequest(config=pb.SessionConfig(request_id=request_id))
    marks["sent"] = time.perf_counter()
    for i in range(0, len(text), TEXT_PIECE_CHARS):
        yield pb.StreamingSynthesizeRequest(text=text[i:i + TEXT_PIECE_CHARS])
    if end:
        yield pb.StreamingSynthesizeRequest(end_input=True)
    else:
        await asyncio.Event().wait()  # keep the input open (a stalled client sends nothing more)


@dataclass
class Heard:
    """What one session received."""

    code: str = "OK"
    message: str = ""
    ttfa_ms: float = math.nan
    arrivals: list[float] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    samples: int = 0
    audio_bytes: int = 0
    max_chunk: int = 0
    gaps: int = 0  # chunks whose offset_samples did not continue the previous one
    rate: int = 0
    summary: pb.SessionSummary | None = None

    @property
    def worst_stall_ms(self) -> float:
        return worst_underrun(self.arrivals, self.durations) * 1000

    def bytes_lost(self) -> int:
        """Bytes of audio the summary promised that did not arrive (beyond one chunk of rounding), plus the size
        of any hole in offset_samples; 0 for a complete stream. -1 when there was no summary."""
        if self.summary is None:
            return -1
        expected = round(self.summary.audio_seconds * self.rate) if self.rate else self.samples
        missing = abs(expected - self.samples)
        lost = 0 if missing <= max(self.max_chunk, 1) else missing * 2
        if self.audio_bytes != self.samples * 2:
            lost += abs(self.audio_bytes - self.samples * 2)
        return lost + self.gaps


async def speak(stub: pb_grpc.TextToSpeechStub, text: str, request_id: str, realtime: bool = False,
                read_for_s: float | None = None) -> Heard:
    """One session: the text at once, end of input, every message read (at real-time pace when `realtime`).
    `read_for_s`: cancel after this long (the result then has code CANCELLED and no summary)."""
    heard = Heard()
    marks: dict[str, float] = {}
    call = stub.StreamingSynthesize(_requests(text, marks, request_id), timeout=SESSION_TIMEOUT_S)
    opened = time.perf_counter()
    next_offset = 0
    play_start = 0.0
    queued = 0.0  # audio seconds received so far

    async def read() -> None:
        nonlocal next_offset, play_start, queued
        async for msg in call:
            kind = msg.WhichOneof("response")
            if kind == "audio" and msg.audio.num_samples:
                now = time.perf_counter()
                a = msg.audio
                if not heard.arrivals:
                    heard.ttfa_ms = (now - marks.get("sent", opened)) * 1000
                    play_start = now
                heard.arrivals.append(now)
                heard.durations.append(a.duration_seconds)
                heard.rate = a.sample_rate_hz
                if a.offset_samples != next_offset:
                    heard.gaps += abs(a.offset_samples - next_offset) * 2
                next_offset = a.offset_samples + a.num_samples
                heard.samples += a.num_samples
                heard.audio_bytes += len(a.audio)
                heard.max_chunk = max(heard.max_chunk, a.num_samples)
                queued += a.duration_seconds
                if realtime:  # take the next chunk only when the player is about to need it
                    wait = play_start + queued - PLAYER_BUFFER_S - time.perf_counter()
                    if wait > 0:
                        await asyncio.sleep(wait)
            elif kind == "summary":
                heard.summary = msg.summary

    try:
        if read_for_s is None:
            await read()
        else:
            try:
                await asyncio.wait_for(read(), read_for_s)
            except TimeoutError:
                call.cancel()
                heard.code = "CANCELLED"
    except grpc.aio.AioRpcError as exc:
        heard.code, heard.message = exc.code().name, exc.details() or ""
    return heard


# ---- scenarios ------------------------------------------------------------------------------------------------


async def scenario_stalled(stub: pb_grpc.TextToSpeechStub, server: LocalServer, cfg: SoakConfig) -> Result:
    res = Result("stalled")
    before = server.rss()
    core_before = rss_by_kind(server.processes())["core"]
    sampler = RssSampler(server)
    sampler.start()
    calls = []
    for i in range(cfg.stall_sessions):
        marks: dict[str, float] = {}
        calls.append(stub.StreamingSynthesize(_requests(long_text(cfg.stall_chars, seed=i), marks, f"stall-{i}"),
                                              timeout=SESSION_TIMEOUT_S))
    await asyncio.sleep(cfg.stall_window_s)
    peak = await sampler.stop()
    for c in calls:
        c.cancel()
    codes = []
    for c in calls:
        try:
            codes.append((await c.code()).name)
        except asyncio.CancelledError:
            codes.append("CANCELLED")
    await asyncio.sleep(1.0)
    after1 = server.rss()
    await asyncio.sleep(2.0)
    after2 = server.rss()
    res.figures = {
        "sessions": cfg.stall_sessions, "chars": cfg.stall_chars, "window_s": cfg.stall_window_s,
        "rss_before_mb": before / MB, "rss_peak_mb": peak / MB, "peak_delta_mb": (peak - before) / MB,
        "after_cancel_mb": after2 / MB, "growth_after_cancel_mb": (after2 - after1) / MB,
        "core_peak_delta_mb": (sampler.peaks.get("core", 0) - core_before) / MB,
    }
    bad = [c for c in codes if c not in ("CANCELLED", "OK")]
    if bad:
        res.failures.append(f"statuses {bad}")
    if after2 - after1 > 20 * MB:
        res.failures.append("RSS still growing after cancel")
    return res


async def scenario_fair(stub: pb_grpc.TextToSpeechStub, server: LocalServer, cfg: SoakConfig) -> Result:
    res = Result("fair")
    long_task = asyncio.create_task(speak(stub, long_text(cfg.fair_long_chars, seed=7), "fair-long", realtime=True,
                                          read_for_s=cfg.fair_long_window_s))
    await asyncio.sleep(cfg.fair_delay_s)
    short = await speak(stub, SHORT_TEXT, "fair-short", realtime=True)
    long = await long_task
    res.figures = {
        "long_chars": cfg.fair_long_chars, "short_ttfa_ms": short.ttfa_ms, "short_worst_stall_ms": short.worst_stall_ms,
        "short_audio_s": sum(short.durations), "long_ttfa_ms": long.ttfa_ms,
        "long_worst_stall_ms": long.worst_stall_ms, "long_audio_read_s": sum(long.durations),
        "short_bytes_lost": short.bytes_lost(),
    }
    if short.code != "OK":
        res.failures.append(f"short session {short.code}: {short.message}")
    if long.code not in ("OK", "CANCELLED"):
        res.failures.append(f"long session {long.code}: {long.message}")
    if short.bytes_lost() != 0:
        res.failures.append(f"short session lost {short.bytes_lost()} bytes")
    return res


def _check(heard: Heard, tally: dict[str, int]) -> None:
    tally["sessions"] += 1
    if heard.code != "OK":
        tally["errors"] += 1
        tally.setdefault(f"{heard.code}: {heard.message[:80]}", 0)
        tally[f"{heard.code}: {heard.message[:80]}"] += 1
        return
    lost = heard.bytes_lost()
    if lost != 0:
        tally["incomplete"] += 1
        tally["bytes_lost"] += max(lost, 0)
    tally["audio_ms"] += int(sum(heard.durations) * 1000)


async def _healthy_loop(stub: pb_grpc.TextToSpeechStub, until: float, tally: dict[str, int], seed: int,
                        sentences: int = 3) -> None:
    rng = random.Random(seed)
    while time.perf_counter() < until:
        text = " ".join(rng.sample(SENTENCES, sentences))
        _check(await speak(stub, text, f"healthy-{seed}-{tally['sessions']}"), tally)


def _tally() -> dict[str, int]:
    return {"sessions": 0, "errors": 0, "incomplete": 0, "bytes_lost": 0, "audio_ms": 0}


def _extra(tally: dict[str, int]) -> list[str]:
    return [f"{v} x {k}" for k, v in tally.items() if ":" in k]


async def scenario_storm(stub: pb_grpc.TextToSpeechStub, server: LocalServer, cfg: SoakConfig) -> Result:
    res = Result("storm")
    before = server.rss()
    until = time.perf_counter() + cfg.storm_s
    healthy = _tally()
    storm = {"opened": 0, "errors": 0}
    storm_errors: dict[str, int] = {}

    async def stormer(k: int) -> None:
        rng = random.Random(100 + k)
        while time.perf_counter() < until:
            marks: dict[str, float] = {}
            call = stub.StreamingSynthesize(_requests(long_text(rng.randint(50, 600), seed=rng.randint(0, 999)),
                                                      marks, f"storm-{k}", end=rng.random() < 0.5),
                                            timeout=SESSION_TIMEOUT_S)
            storm["opened"] += 1
            with contextlib.suppress(TimeoutError, grpc.aio.AioRpcError, StopAsyncIteration):
                # sometimes cancel before any answer, sometimes after the first audio
                if rng.random() < 0.5:
                    await asyncio.wait_for(call.read(), rng.uniform(0.0, 0.3))
                else:
                    await asyncio.sleep(rng.uniform(0.0, 0.1))
            call.cancel()
            try:
                code = await call.code()
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
            if code not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.OK):
                storm["errors"] += 1
                storm_errors[code.name] = storm_errors.get(code.name, 0) + 1

    await asyncio.gather(*(stormer(k) for k in range(cfg.storm_sessions)),
                         *(_healthy_loop(stub, until, healthy, seed=k) for k in range(2)))
    await asyncio.sleep(1.0)
    after = server.rss()
    res.figures = {
        "storm_sessions": cfg.storm_sessions, "storm_s": cfg.storm_s, "opened_cancelled": storm["opened"],
        "storm_errors": storm["errors"], "healthy_sessions": healthy["sessions"], "healthy_errors": healthy["errors"],
        "bytes_lost": healthy["bytes_lost"], "incomplete": healthy["incomplete"],
        "rss_before_mb": before / MB, "rss_after_mb": after / MB,
    }
    if storm["errors"]:
        res.failures.append(f"storm statuses {storm_errors}")
    if healthy["errors"] or healthy["incomplete"] or healthy["sessions"] < 2:
        res.failures.append(f"healthy sessions: {healthy['errors']} errors, {healthy['incomplete']} incomplete "
                            f"of {healthy['sessions']} {_extra(healthy)}")
    return res


async def scenario_soak(stub: pb_grpc.TextToSpeechStub, server: LocalServer, cfg: SoakConfig) -> Result:
    res = Result("soak")
    start = server.rss()
    until = time.perf_counter() + cfg.soak_s
    tally = _tally()
    t0 = time.perf_counter()
    await asyncio.gather(*(_healthy_loop(stub, until, tally, seed=1000 + k, sentences=4)
                           for k in range(cfg.soak_sessions)))
    wall = time.perf_counter() - t0
    end = server.rss()
    res.figures = {
        "concurrent": cfg.soak_sessions, "soak_s": cfg.soak_s, "sessions_run": tally["sessions"],
        "errors": tally["errors"], "incomplete": tally["incomplete"], "bytes_lost": tally["bytes_lost"],
        "audio_s": tally["audio_ms"] / 1000, "wall_s": wall, "rss_start_mb": start / MB, "rss_end_mb": end / MB,
    }
    if tally["errors"] or tally["incomplete"] or not tally["sessions"]:
        res.failures.append(f"{tally['errors']} errors, {tally['incomplete']} incomplete {_extra(tally)}")
    return res


async def _settled_rss(server: LocalServer, settle_s: float) -> dict[str, int]:
    """Each kind of process's lowest RSS over `settle_s` after a load (sampled every 0.25 s): the
    core gives memory back once it has been idle a moment, which a busy host may delay."""
    low: dict[str, int] = {}
    deadline = time.monotonic() + settle_s
    while True:
        for kind, value in rss_by_kind(server.processes()).items():
            low[kind] = min(low.get(kind, value), value)
        if time.monotonic() >= deadline:
            return low
        await asyncio.sleep(0.25)


async def scenario_memory(stub: pb_grpc.TextToSpeechStub, server: LocalServer, cfg: SoakConfig) -> Result:
    res = Result("memory")
    # The warm-up, as many sessions at once as the load but shorter: what that many need for good (buffers and
    # batch shapes sized once, pools, caches) is in the base, and what the load's length adds must be given back.
    await asyncio.gather(*(speak(stub, long_text(min(cfg.memory_warm_chars, cfg.memory_chars), seed=k), f"warm-{k}")
                           for k in range(cfg.memory_sessions)))
    warm = await _settled_rss(server, cfg.memory_settle_s)
    sampler = RssSampler(server, period_s=0.2)
    sampler.start()
    tally = _tally()
    t0 = time.perf_counter()
    for heard in await asyncio.gather(*(speak(stub, long_text(cfg.memory_chars, seed=500 + k), f"memory-{k}")
                                        for k in range(cfg.memory_sessions))):
        _check(heard, tally)
    wall = time.perf_counter() - t0
    await sampler.stop()
    after = await _settled_rss(server, cfg.memory_settle_s)
    res.figures = {"sessions": cfg.memory_sessions, "chars": cfg.memory_chars, "wall_s": wall,
                   "audio_s": tally["audio_ms"] / 1000, "errors": tally["errors"]}
    for kind in ("core", "api", "frontend"):
        res.figures |= {f"{kind}_warm_mb": warm[kind] / MB, f"{kind}_peak_mb": sampler.peaks.get(kind, 0) / MB,
                        f"{kind}_after_mb": after[kind] / MB}
    kept = (after["core"] - warm["core"]) / MB
    added = (sampler.peaks.get("core", 0) - warm["core"]) / MB
    bound = max(cfg.memory_kept_mb, (1 - cfg.memory_kept_share) * added)
    res.figures |= {"core_added_mb": added, "core_kept_mb": kept}
    if tally["errors"] or tally["incomplete"]:
        res.failures.append(f"{tally['errors']} errors, {tally['incomplete']} incomplete {_extra(tally)}")
    if not warm["core"]:
        res.failures.append(f"no engine core process ({CORE_PROCESS_NAME}) among the server's")
    elif kept > bound:
        res.failures.append(f"the core kept {kept:.0f} of the {added:.0f} MB the load added (bound {bound:.0f})")
    return res


SCENARIOS = {"stalled": scenario_stalled, "fair": scenario_fair, "storm": scenario_storm, "soak": scenario_soak,
             "memory": scenario_memory}


# ---- the run --------------------------------------------------------------------------------------------------


async def _drive(address: str, server: LocalServer, cfg: SoakConfig, out: IO[str]) -> tuple[dict[str, Result], str]:
    channel = grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    try:
        await wait_until_serving(channel, address, SERVER_START_TIMEOUT_S)
        stub = pb_grpc.TextToSpeechStub(channel)
        info = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        desc = f"{info.backend} on {info.device}, voice {info.default_voice}"
        print(f"soak: server {address} (pid {server.pid}): {desc}", file=out, flush=True)
        print(server.rss_line(), file=out, flush=True)
        results: dict[str, Result] = {}
        for name in cfg.scenarios:
            results[name] = await SCENARIOS[name](stub, server, cfg)
            print(results[name].line(), file=out, flush=True)
            print(server.rss_line(), file=out, flush=True)
        return results, desc
    finally:
        await channel.close()


@contextlib.contextmanager
def _log_file(path: Path | None) -> Iterator[IO[bytes]]:
    if path is not None:
        with path.open("w+b") as f:
            yield f
    else:
        with tempfile.TemporaryFile("w+b") as f:
            yield f


def run_soak(cfg: SoakConfig, server_args: Sequence[str] = (), log_path: Path | None = None,
             out: IO[str] | None = None) -> SoakReport:
    """Start a local server with `server_args`, run the scenarios, stop it (SIGTERM) and report."""
    out = out or sys.stdout
    unknown = set(cfg.scenarios) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    with _log_file(log_path) as log:
        server = LocalServer(server_args, log)
        try:
            address = server.wait_address()
            results, desc = asyncio.run(_drive(address, server, cfg, out))
        finally:
            code = server.stop()
        log.flush()
        log.seek(0)
        errors = sum(" ERROR " in line for line in log.read().decode("utf-8", "replace").splitlines())
    report = SoakReport(results, code, desc, errors)
    print(f"soak: server exit {code}, {errors} ERROR lines in its log; {'PASS' if report.passed else 'FAIL'}",
          file=out, flush=True)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", action="store_true", help="the CI-sized variant (default: the long one)")
    p.add_argument("--tiny", action="store_true",
                   help=f"serve the tiny test voice {TINY_VOICE.relative_to(ROOT)} (default: the built-in voice)")
    p.add_argument("--voice", default=None, help="a voice name or .onnx path for the server")
    p.add_argument("--device", default="cpu", help="the server's device (default: cpu)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset to run")
    p.add_argument("--max-ahead", type=float, default=None, help="the server's --max-ahead (default: its own)")
    p.add_argument("--log", default=None, metavar="FILE", help="write the server's log here (default: discarded)")
    p.add_argument("--memory-sessions", type=int, default=None, help="sessions at once in the memory scenario")
    p.add_argument("--memory-chars", type=int, default=None, help="characters per session in the memory scenario")
    p.add_argument("server_args", nargs="*", help="more `cadenza serve` options, after --")
    args = p.parse_args(argv)
    cfg = SoakConfig.short() if args.short else SoakConfig()
    names = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    cfg = dataclasses.replace(cfg, scenarios=names)
    if args.memory_sessions is not None:
        cfg = dataclasses.replace(cfg, memory_sessions=args.memory_sessions)
    if args.memory_chars is not None:
        cfg = dataclasses.replace(cfg, memory_chars=args.memory_chars)
    voice = str(TINY_VOICE) if args.tiny else args.voice
    server_args = ["--device", args.device, "--admission-wait", "0"]
    if voice:
        server_args += ["--voice", voice]
    if args.max_ahead is not None:
        server_args += ["--max-ahead", str(args.max_ahead)]
    server_args += args.server_args
    report = run_soak(cfg, server_args, Path(args.log) if args.log else None)
    return 0 if report.passed else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
