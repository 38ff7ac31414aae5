#!/usr/bin/env python3
"""Telemetry overhead, side by side in one run: two `cadenza serve` processes on this machine,
one plain, one with metrics and traces on (a Prometheus endpoint scraped every second and OTLP
export of spans and metrics to a local receiver), loaded in turn by
`cadenza bench load --sessions N --arrival burst` (the order alternates every round).

    PYTHONPATH=. .venv/bin/python scripts/telemetry_overhead.py [--rounds 6] [--sessions 4]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.telemetry.otlp_sink import OtlpSink  # noqa: E402

CLI = [sys.executable, "-m", "service.cli"]
FIELDS = ("pass_rate", "ttfa_p50_ms", "ttfa_p99_ms", "rtfx", "server_cpu_s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (its main process: where telemetry runs). Less
    disturbed than wall times by other work on a shared machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(extra: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen([*CLI, "serve", "--host", "127.0.0.1", "--port", "0", *extra], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if m := re.search(r"serving on \S+:(\d+)", line):
            return process, int(m.group(1))
    raise RuntimeError("the server did not start")


def load(port: int, pid: int, sessions: int, seed: int) -> dict[str, float]:
    before = cpu_seconds(pid)
    done = subprocess.run([*CLI, "bench", "load", "--target", f"127.0.0.1:{port}", "--sessions", str(sessions),
                           "--arrival", "burst", "--seed", str(seed)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=True)
    last = done.stdout.strip().splitlines()[-1]
    row = {k: float(v) for k, v in re.findall(r"(\w+)=([0-9.]+)", last) if k in FIELDS}
    row["server_cpu_s"] = cpu_seconds(pid) - before
    return row


def micro(repeats: int = 2000) -> None:
    """The instrumentation's own cost per call: real SDK providers (spans batched to the OTLP
    receiver) against the no-op default, in this process."""
    import time

    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from service.telemetry import SessionInfo, Telemetry

    sink = OtlpSink()
    tracer = TracerProvider()
    tracer.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=sink.endpoint, insecure=True)))
    kinds = {"off": Telemetry(), "on": Telemetry(MeterProvider(metric_readers=[InMemoryMetricReader()]), tracer)}
    for name, t in kinds.items():
        sessions = [t.session_opened(SessionInfo(i, "v", "fp32", "cpu", "LINEAR16", 22050)) for i in range(64)]

        def step(rows: int, first: bool, t: Telemetry = t) -> None:
            now = time.monotonic()
            t.decoder_step([(i, "v", first and i == 0) for i in range(rows)],
                           [(i, "v", False, 0.05) for i in range(rows)], now, now + 0.01, now + 0.011, 0)

        def session(k: int, t: Telemetry = t) -> None:
            r = t.session_opened(SessionInfo(1000 + k, "v", "fp32", "cpu", "LINEAR16", 22050))
            t.first_audio(r, 0.05)
            for c in range(20):
                r.chunk(c * 0.1, 0.1)
            t.utterance_queued(1000 + k, 0, 0.0)
            t.acoustic_step([(1000 + k, 0)], 0.0, 0.01)
            t.utterance_done(1000 + k, 0, 20, 100, 40, "fp32", False, 1.0)
            t.session_ended(r, None, False, 40, 0)

        cases: dict[str, Callable[[int], None]] = {
            "decoder step, 4 rows": lambda k: step(4, False), "decoder step, 64 rows": lambda k: step(64, False),
            "decoder step making a first chunk, 4 rows": lambda k: step(4, True), "session (1 utterance)": session}
        for label, case in cases.items():
            start = time.perf_counter()
            for k in range(repeats):
                case(k)
            print(f"  telemetry {name:3}: {label:45} {(time.perf_counter() - start) / repeats * 1e6:7.1f} us")
        for r in sessions:
            t.session_ended(r, None, True, 0, 0)
    tracer.shutdown()
    sink.close()
    timeline_micro(repeats * 50)


def timeline_micro(repeats: int) -> None:
    """`serve --timeline`'s cost per event on the recording thread, on and off."""
    import tempfile
    import time

    from service.telemetry.timeline import Timeline

    with tempfile.TemporaryDirectory() as directory:
        for name, timeline in (("off", Timeline()), ("on", Timeline(Path(directory), "core"))):
            def timed(t: Timeline = timeline) -> None:
                with t.timed("launch", rows=64, first=True, frames=77):
                    pass

            cases: dict[str, Callable[[], None]] = {
                "event (add)": lambda t=timeline: t.add("text", sid=1, seq=0, sentences=1, sent=0.0, phonemized=0.0),
                "timed call (launch, acoustic, ...)": timed}
            for label, case in cases.items():
                start = time.perf_counter()
                for _ in range(repeats):
                    case()
                print(f"  timeline  {name:3}: {label:45} {(time.perf_counter() - start) / repeats * 1e6:7.2f} us")
                timeline._events.clear()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--micro", action="store_true", help="only the per-call cost of the instrumentation")
    args = parser.parse_args()
    print("instrumentation cost per call (this process):")
    micro()
    if args.micro:
        return 0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sink = OtlpSink()
    metrics_port = free_port()
    off, off_port = start([], env)
    on, on_port = start(["--metrics-port", str(metrics_port)], {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint})
    ports = {"off": off_port, "on": on_port}
    stop = threading.Event()

    def scrape() -> None:  # as Prometheus would
        while not stop.wait(1.0):
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
                r.read()

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    results: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    try:
        for k in range(args.rounds):
            order = [("off", off), ("on", on)] if k % 2 == 0 else [("on", on), ("off", off)]
            for name, process in order:
                row = load(ports[name], process.pid, args.sessions, seed=k)
                results[name].append(row)
                print(f"round {k} {name:3}: " + " ".join(f"{f}={row[f]:g}" for f in FIELDS), flush=True)
    finally:
        stop.set()
        for process in (off, on):
            process.send_signal(signal.SIGTERM)
            process.wait(60)
        sink.close()
    print(f"OTLP receiver got {len(sink.span_names)} spans and {len(sink.metric_names)} metric names")
    print("median over rounds:")
    for name in ("off", "on"):
        print(f"  telemetry {name:3}: " + " ".join(
            f"{f}={statistics.median(r[f] for r in results[name]):.3f}" for f in FIELDS))
    ratios = {f: statistics.median(results["on"][i][f] / results["off"][i][f] for i in range(args.rounds)
                                   if results["off"][i][f]) for f in FIELDS}
    print("  on/off (median of per-round ratios): " + " ".join(f"{f}={ratios[f]:.3f}" for f in FIELDS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
