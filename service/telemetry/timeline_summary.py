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

With a client timeline in the same directory (`cadenza bench load --timeline DIR` on the same
host), two more: from the client to the server (the client sent its first text until the server
took it: the client's loop, the network, gRPC and the server's event loop), and from the server
to the client (until the client had the first audio), with the client's own TTFA.

The engine thread's calls carry their wall time and the thread's CPU time in them: a thread
waiting for the GIL uses no CPU; one waiting for the device in a synchronisation spins, so it
does."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from service.telemetry.histogram import percentile
from service.telemetry.timeline import LOOP_LAG_RECORDED_S

STAGES = ("to the core", "phonemise", "to the engine thread", "wait for acoustic", "acoustic",
          "wait for a step", "decoder step", "to the server")


CLIENT_STAGES = ("client to server", "server to client")


@dataclass(frozen=True)
class SessionPath:
    """One session's first audio, stage by stage (seconds), and its server-side TTFA; with
    the client's side, `client` holds CLIENT_STAGES and "client TTFA"."""

    sid: int
    stages: dict[str, float]
    ttfa_s: float
    text_in: float
    client: dict[str, float] | None = None


@dataclass
class Recorded:
    """Everything under a timeline directory: the core's busy periods (file, events) in time
    order; per server session id its first text in and first audio out, and its request id;
    per request id the client's sessions (first text sent, first audio received)."""

    periods: list[tuple[Path, list[dict[str, object]]]]
    api: dict[int, dict[str, float]]
    request_ids: dict[int, str]
    client: dict[str, list[tuple[float, float]]]
    api_gc: list[dict[str, object]] = field(default_factory=list)  # the server process's collections
    api_lag: list[dict[str, object]] = field(default_factory=list)  # its event loop, each time it was late


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


def load(directory: Path) -> Recorded:
    """What `serve --timeline` (and `bench load --timeline`) wrote under `directory`. Session
    ids are the server's, shared by its two sides; request ids tie the client to the server."""
    periods = [(p, read_events(p)) for p in directory.glob("core-*.jsonl")]
    periods = [(p, ev) for p, ev in periods if ev]
    periods.sort(key=lambda item: _f(item[1][0], "t"))
    recorded = Recorded(periods, {}, {}, {})
    for path in directory.glob("api-*.jsonl"):
        for e in read_events(path):
            if e["k"] in ("text_in", "audio_out"):
                recorded.api.setdefault(_i(e, "sid"), {})[str(e["k"])] = _f(e, "t")
            if e["k"] == "text_in" and e.get("rid"):
                recorded.request_ids[_i(e, "sid")] = str(e["rid"])
            if e["k"] == "gc":
                recorded.api_gc.append(e)
            if e["k"] == "loop_lag":
                recorded.api_lag.append(e)
    for path in directory.glob("client-*.jsonl"):
        for e in read_events(path):
            if e["k"] == "client":
                recorded.client.setdefault(str(e["rid"]), []).append((_f(e, "first_text"), _f(e, "first_audio")))
    return recorded


def _client_side(recorded: Recorded, sid: int, text_in: float, audio_out: float) -> dict[str, float] | None:
    """The client's stages of server session `sid`: its session with the same request id that
    sent its first text last before the server took it in (request ids repeat across runs)."""
    rid = recorded.request_ids.get(sid)
    sent = [c for c in recorded.client.get(rid, []) if c[0] <= text_in] if rid else []
    if not sent:
        return None
    first_text, first_audio = max(sent)
    to_server, to_client = CLIENT_STAGES
    return {to_server: text_in - first_text, to_client: max(0.0, first_audio - audio_out),
            "client TTFA": first_audio - first_text}


def _taken_in(texts: Sequence[Event], sent: float) -> float | None:
    """When the engine thread took in the text that was handed to the frontend at `sent` (the
    one that gave the first sentence). Texts are taken in in the order they were sent, so that
    is once it and every text sent before it had arrived (they may finish phonemising out of order)."""
    seq = next((_i(e, "seq") for e in texts if _f(e, "sent") == sent), None)
    if seq is None:
        return None
    return max(_f(e, "t") for e in texts if _i(e, "seq") <= seq)


def session_paths(core: Sequence[Event], recorded: Recorded) -> list[SessionPath]:
    """The period's client sessions (those the server recorded) that got their first audio."""
    api = recorded.api
    texts: dict[int, list[Event]] = {}  # sid -> its texts, as they reached the engine thread
    for e in core:
        if e["k"] == "text":
            texts.setdefault(_i(e, "sid"), []).append(e)
    out = []
    for e in core:
        if e["k"] != "first_audio":
            continue
        sid = _i(e, "sid")
        server = api.get(sid, {})
        if "text_in" not in server or "audio_out" not in server:
            continue  # a warm-up session
        if any(e[k] is None for k in ("sent", "phonemized", "acoustic_start", "acoustic_end", "step_start")):
            continue  # a cached replay
        taken = _taken_in(texts.get(sid, []), _f(e, "sent"))
        if taken is None:
            continue
        points = [server["text_in"], _f(e, "sent"), _f(e, "phonemized"), taken, _f(e, "acoustic_start"),
                  _f(e, "acoustic_end"), _f(e, "step_start"), _f(e, "t"), server["audio_out"]]
        stages = {name: max(0.0, b - a) for name, (a, b) in zip(STAGES, itertools.pairwise(points), strict=True)}
        out.append(SessionPath(sid, stages, server["audio_out"] - server["text_in"], server["text_in"],
                               _client_side(recorded, sid, server["text_in"], server["audio_out"])))
    return out


PERCENTILES = (0, 50, 90, 99, 100)  # linear between ranks, as `bench load` reports them
_LABELS = {0: "min", 100: "max"}


def _row(name: str, seconds: Sequence[float]) -> str:
    return f"  {name:22s}" + "".join(f"{percentile(seconds, q) * 1000:8.1f}" for q in PERCENTILES)


def _calls(core: Sequence[Event], kind: str, size: str) -> tuple[int, float, float, float, float]:
    """(count, mean `size` per call, wall, CPU and run-queue seconds) of the engine thread's
    `kind` calls (timelines from before the run-queue figure count 0 for it)."""
    calls = [e for e in core if e["k"] == kind]
    if not calls:
        return 0, 0.0, 0.0, 0.0, 0.0
    wall = sum(_f(e, "t") - _f(e, "s") for e in calls)
    cpu = sum(_f(e, "cpu") for e in calls)
    ready = sum(_f(e, "ready") if "ready" in e else 0.0 for e in calls)
    return len(calls), sum(_i(e, size) for e in calls) / len(calls), wall, cpu, ready


def summarise(core: Sequence[Event], recorded: Recorded) -> list[str]:
    """Lines for one busy period of the core; empty when it served no client session."""
    paths = session_paths(core, recorded)
    if not paths:
        return []
    start = min(p.text_in for p in paths)
    end = max(p.text_in + p.ttfa_s for p in paths)
    lines = [f"{len(paths)} sessions; first text in to last first audio out: {(end - start) * 1000:.1f} ms",
             f"  {'ms':22s}" + "".join(f"{_LABELS.get(q, f'p{q}'):>8s}" for q in PERCENTILES)]
    clients = [p.client for p in paths if p.client is not None]
    to_server, to_client = CLIENT_STAGES
    if clients:
        lines.append(_row(to_server, [c[to_server] for c in clients]))
    lines += [_row(name, [p.stages[name] for p in paths]) for name in STAGES]
    lines.append(_row("server TTFA", [p.ttfa_s for p in paths]))
    if clients:
        lines.append(_row(to_client, [c[to_client] for c in clients]))
        lines.append(_row("client TTFA", [c["client TTFA"] for c in clients]) + f"   (client side of {len(clients)})")
    taken = sorted(p.text_in for p in paths)
    if len(taken) > 1:
        gaps = [b - a for a, b in itertools.pairwise(taken)]
        lines.append(f"the server took their first texts in over {(taken[-1] - taken[0]) * 1000:.1f} ms "
                     f"(from one to the next: p50 {percentile(gaps, 50) * 1000:.2f} ms, "
                     f"longest {max(gaps) * 1000:.1f} ms)")
    window = [e for e in core if start <= _f(e, "t") <= end]
    plans = sum(1 for e in window if e["k"] == "plan")
    lines.append(f"engine thread in that window: {plans} iterations with work")
    for kind, size, label in (("acoustic", "sentences", "acoustic calls"), ("tokens", "rows", "token steps"),
                              ("launch", "rows", "step launches"), ("landed", "rows", "step results"),
                              ("chunk", "frames", "staged chunks")):
        n, mean, wall, cpu, ready = _calls(window, kind, size)
        if n:
            lines.append(f"  {label:15s} {n:4d} x {mean:5.1f} {size:9s} wall {wall * 1000:7.1f} ms, "
                         f"CPU {cpu * 1000:7.1f} ms, waiting for a CPU {ready * 1000:7.1f} ms")
    lags = [_f(e, "lag") for e in recorded.api_lag if start <= _f(e, "t") <= end]
    if lags:
        lines.append(f"server event loop: late by more than {LOOP_LAG_RECORDED_S * 1000:g} ms {len(lags)} times, "
                     f"{sum(lags) * 1000:.1f} ms in all, longest {max(lags) * 1000:.1f} ms")
    for side, events in (("core", window), ("server", [e for e in recorded.api_gc if start <= _f(e, "t") <= end])):
        collections = [e for e in events if e["k"] == "gc"]
        if collections:
            pauses = [_f(e, "t") - _f(e, "s") for e in collections]
            full = sum(1 for e in collections if e["generation"] == 2)
            lines.append(f"garbage collections in the {side} process: {len(pauses)} ({full} full), "
                         f"{sum(pauses) * 1000:.1f} ms in all, longest {max(pauses) * 1000:.1f} ms")
    return lines


def report(directory: Path) -> list[str]:
    recorded = load(directory)
    out: list[str] = []
    for path, events in recorded.periods:
        lines = summarise(events, recorded)
        if lines:
            out += [f"{path.name}: {lines[0]}", *lines[1:], ""]
    return out or [f"no client sessions in the timeline files under {directory} (serve --timeline DIR)"]


__all__ = ["CLIENT_STAGES", "STAGES", "Recorded", "SessionPath", "load", "report", "session_paths",
           "summarise"]
