"""Where a profiled period's time went, from a `torch.profiler` Chrome trace (`--profile DIR`
on `serve` or `bench streams` writes one per busy period of the core, with this summary beside it).

    python -m service.telemetry.trace_summary DIR/core-1.json

Prints: how busy the device was; for each engine range (service/telemetry/ranges.py) its count and
host time, the device time of the kernels launched inside it (summed, and first start to last
end) and how long after the range's start that work ended; the runtime calls the host waited in;
the kernels that took the most device time."""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

Event = dict[str, Any]


def _union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarise(trace: dict[str, Any], top: int = 15) -> list[str]:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    if not events:
        return ["no events"]
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    wall = t1 - t0
    lines = [f"window {wall / 1000:.1f} ms, {len(kernels)} device ops, {len(ranges)} engine ranges"]
    if kernels:
        busy = _union_us([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
        lines.append(f"device busy {busy / 1000:.1f} ms ({100 * busy / wall:.0f}% of the window); "
                     f"summed device op time {sum(k['dur'] for k in kernels) / 1000:.1f} ms")

    # Device work by launching call: correlation id -> device ops.
    by_corr: dict[int, list[Event]] = defaultdict(list)
    for k in kernels:
        corr = k.get("args", {}).get("correlation")
        if corr is not None:
            by_corr[corr].append(k)
    launches: dict[Any, list[tuple[float, int]]] = defaultdict(list)  # tid -> (ts, correlation), sorted
    for r in runtime:
        corr = r.get("args", {}).get("correlation")
        if corr in by_corr:
            launches[r["tid"]].append((r["ts"], corr))
    for v in launches.values():
        v.sort()

    def inside(e: Event) -> list[Event]:
        found: list[Event] = []
        calls = launches.get(e["tid"], [])
        i = bisect.bisect_left(calls, (e["ts"], -1))
        while i < len(calls) and calls[i][0] <= e["ts"] + e["dur"]:
            found += by_corr[calls[i][1]]
            i += 1
        return found

    stats: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e in ranges:
        ops = inside(e)
        s = stats[e["name"]]
        s["host"].append(e["dur"])
        s["device"].append(sum(k["dur"] for k in ops))
        if ops:
            start, end = min(k["ts"] for k in ops), max(k["ts"] + k["dur"] for k in ops)
            s["span"].append(end - start)
            s["done_after"].append(end - e["ts"])
    if stats:
        lines.append("")
        lines.append(f"{'range':<22} {'count':>6} {'host ms':>9} {'mean':>7} {'p90':>7}   "
                     f"{'device mean':>11} {'span mean':>9} {'done after':>10}")
        for name, s in sorted(stats.items(), key=lambda kv: -sum(kv[1]["host"])):
            host = s["host"]
            p90 = sorted(host)[int(0.9 * (len(host) - 1))]
            dev = statistics.fmean(s["device"]) / 1000 if s["device"] else 0.0
            span = statistics.fmean(s["span"]) / 1000 if s["span"] else 0.0
            after = statistics.fmean(s["done_after"]) / 1000 if s["done_after"] else 0.0
            lines.append(f"{name:<22} {len(host):6d} {sum(host) / 1000:9.1f} {statistics.fmean(host) / 1000:7.2f} "
                         f"{p90 / 1000:7.2f}   {dev:11.2f} {span:9.2f} {after:10.2f}")

    waits: dict[str, list[float]] = defaultdict(list)
    for r in runtime:
        waits[r["name"]].append(r["dur"])
    if waits:
        lines.append("")
        lines.append(f"{'runtime call (host)':<40} {'count':>7} {'total ms':>9} {'mean us':>8}")
        for name, d in sorted(waits.items(), key=lambda kv: -sum(kv[1]))[:10]:
            lines.append(f"{name[:40]:<40} {len(d):7d} {sum(d) / 1000:9.1f} {statistics.fmean(d):8.1f}")

    if kernels:
        per: dict[str, list[float]] = defaultdict(list)
        for k in kernels:
            per[k["name"]].append(k["dur"])
        total = sum(k["dur"] for k in kernels)
        lines.append("")
        lines.append(f"{'device ms':>9} {'share':>6} {'count':>7} {'mean us':>8}  device op")
        for name, d in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]:
            lines.append(f"{sum(d) / 1000:9.1f} {100 * sum(d) / total:5.1f}% {len(d):7d} {statistics.fmean(d):8.1f}  "
                         f"{name[:80]}")

    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=15, help="kernels to list")
    args = parser.parse_args()
    for path in args.traces:
        print(f"== {path}")
        print("\n".join(summarise(json.loads(path.read_text()), args.top)))


if __name__ == "__main__":
    main()
