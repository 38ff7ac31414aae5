"""`cadenza timeline DIR`: where the sessions of each busy period recorded by `serve --timeline`
spent their time to first audio, stage by stage, and what the engine thread did meanwhile.

Stages of one session, each from the end of the one before (monotonic seconds, the same clock in
the server's and the core's processes):

* to the core: the server took the first text until the core handed it to the frontend (the
  pipe, and the core's thread that reads it);
* phonemise: the frontend pool phonemised it;
* to the engine thread: until the engine thread took the sentences in (it does so between
  iterations);
* wait for acoustic: until the acoustic-stage call that ran it started;
* acoustic: that call;
* wait for a step: until the decoder step that made the first chunk started;
* decoder step: until that chunk was delivered;
* to the server: until the server queued it for the client (the pipe back, the relay thread).

The engine thread's calls carry their wall time and the thread's CPU time in them: a thread
waiting for the GIL uses no CPU; one waiting for the device in a synchronisation spins, so it
does."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

STAGES = ("to the core", "phonemise", "to the engine thread", "wait for acoustic", "acoustic",
          "wait for a step", "decoder step", "to the server")


@dataclass(frozen=True)
class SessionPath:
    """One session's first audio, stage by stage (seconds), and its server-side TTFA."""

    sid: int
    stages: dict[str, float]
    ttfa_s: float
    text_in: float


Event = Mapping[str, object]


def _f(e: Event, key: str) -> float:
    value = e[key]
    assert isinstance(value, int | float), (key, value)
    return float(value)


def _i(e: Event, key: str) -> int:
    value = e[key]
    assert isinstance(value, int), (key, value)
    return value


def read_events(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]


def load(directory: Path) -> tuple[list[tuple[Path, list[dict[str, object]]]], dict[int, dict[str, float]]]:
    """The core's busy periods (file, events) in time order, and the server's first text and
    first audio per session id (session ids are the server's, shared by both sides)."""
    periods = [(p, read_events(p)) for p in directory.glob("core-*.jsonl")]
    periods = [(p, ev) for p, ev in periods if ev]
    periods.sort(key=lambda item: _f(item[1][0], "t"))
    api: dict[int, dict[str, float]] = {}
    for path in directory.glob("api-*.jsonl"):
        for e in read_events(path):
            if e["k"] in ("text_in", "audio_out"):
                api.setdefault(_i(e, "sid"), {})[str(e["k"])] = _f(e, "t")
    return periods, api


def session_paths(core: Sequence[Event], api: Mapping[int, Mapping[str, float]]) -> list[SessionPath]:
    """The period's client sessions (those the server recorded) that got their first audio."""
    taken_in: dict[int, float] = {}  # sid -> when the engine thread took its first sentences in
    for e in core:
        if e["k"] == "text" and e["sentences"] and _i(e, "sid") not in taken_in:
            taken_in[_i(e, "sid")] = _f(e, "t")
    out = []
    for e in core:
        if e["k"] != "first_audio":
            continue
        sid = _i(e, "sid")
        server = api.get(sid, {})
        if "text_in" not in server or "audio_out" not in server or sid not in taken_in:
            continue  # a warm-up session, or a cached replay
        if any(e[k] is None for k in ("sent", "phonemized", "acoustic_start", "acoustic_end", "step_start")):
            continue
        points = [server["text_in"], _f(e, "sent"), _f(e, "phonemized"), taken_in[sid], _f(e, "acoustic_start"),
                  _f(e, "acoustic_end"), _f(e, "step_start"), _f(e, "t"), server["audio_out"]]
        stages = {name: max(0.0, b - a) for name, (a, b) in zip(STAGES, itertools.pairwise(points), strict=True)}
        out.append(SessionPath(sid, stages, server["audio_out"] - server["text_in"], server["text_in"]))
    return out


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest rank, as `bench load` reports its percentiles."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


QUANTILES = (0.0, 0.5, 0.9, 0.99, 1.0)


def _row(name: str, seconds: Sequence[float]) -> str:
    return f"  {name:22s}" + "".join(f"{quantile(seconds, q) * 1000:8.1f}" for q in QUANTILES)


def _calls(core: Sequence[Event], kind: str, size: str) -> tuple[int, float, float, float]:
    """(count, mean `size` per call, wall seconds, CPU seconds) of the engine thread's `kind` calls."""
    calls = [e for e in core if e["k"] == kind]
    if not calls:
        return 0, 0.0, 0.0, 0.0
    wall = sum(_f(e, "t") - _f(e, "s") for e in calls)
    cpu = sum(_f(e, "cpu") for e in calls)
    return len(calls), sum(_i(e, size) for e in calls) / len(calls), wall, cpu


def summarise(core: Sequence[Event], api: Mapping[int, Mapping[str, float]]) -> list[str]:
    """Lines for one busy period of the core; empty when it served no client session."""
    paths = session_paths(core, api)
    if not paths:
        return []
    start = min(p.text_in for p in paths)
    end = max(p.text_in + p.ttfa_s for p in paths)
    lines = [f"{len(paths)} sessions; first text in to last first audio out: {(end - start) * 1000:.1f} ms",
             f"  {'ms':22s}" + "".join(f"{name:>8s}" for name in ("min", "p50", "p90", "p99", "max"))]
    lines += [_row(name, [p.stages[name] for p in paths]) for name in STAGES]
    lines.append(_row("server TTFA", [p.ttfa_s for p in paths]))
    window = [e for e in core if start <= _f(e, "t") <= end]
    plans = sum(1 for e in window if e["k"] == "plan")
    lines.append(f"engine thread in that window: {plans} iterations with work")
    for kind, size, label in (("acoustic", "sentences", "acoustic calls"), ("launch", "rows", "step launches"),
                              ("landed", "rows", "step results"), ("chunk", "frames", "staged chunks")):
        n, mean, wall, cpu = _calls(window, kind, size)
        if n:
            lines.append(f"  {label:15s} {n:4d} x {mean:5.1f} {size:9s} wall {wall * 1000:7.1f} ms, "
                         f"CPU {cpu * 1000:7.1f} ms")
    return lines


def report(directory: Path) -> list[str]:
    periods, api = load(directory)
    out: list[str] = []
    for path, events in periods:
        lines = summarise(events, api)
        if lines:
            out += [f"{path.name}: {lines[0]}", *lines[1:], ""]
    return out or [f"no client sessions in the timeline files under {directory} (serve --timeline DIR)"]


__all__ = ["STAGES", "SessionPath", "load", "quantile", "report", "session_paths", "summarise"]
