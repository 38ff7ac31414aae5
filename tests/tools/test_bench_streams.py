"""`cadenza bench streams --profile`: real rounds through the engine on CPU, the core (in its own
process) recording each round's busy period."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.telemetry.ranges import BusyProfiler
from service.tools.bench_streams import run_streams_bench


def _range_rows(summary: str) -> dict[str, tuple[int, float]]:
    """range name -> (count, host ms) from a core-N.txt summary's range table."""
    lines = summary.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("range "))
    rows = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        name, count, host = line.split()[:3]
        rows[name] = (int(count), float(host))
    return rows


def test_profile_records_each_round_of_the_core(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "prof"
    assert run_streams_bench("cpu", "torch", [1], ["fp32"], profile_dir=prof) == 0
    # The round ran and reported (its figures include the profiler's overhead, so not whether it passed).
    assert any(line.split()[:2] == ["1", "fp32"] for line in capsys.readouterr().out.splitlines())
    # The warm-up round and the measured one (the server's own warm-up sessions are not recorded).
    # A period is cut after BusyProfiler.MAX_PERIOD_S, so on a slow machine a round may take two.
    files = sorted(p.name for p in prof.iterdir())
    periods = len(files) // 2
    assert 2 <= periods <= BusyProfiler.MAX_PERIODS
    assert files == sorted(f"core-{k}.{ext}" for k in range(1, periods + 1) for ext in ("json", "txt"))
    names: set[object] = set()
    rows: dict[str, tuple[int, float]] = {}
    for k in range(1, periods + 1):
        trace = json.loads((prof / f"core-{k}.json").read_text())
        names |= {e.get("name") for e in trace["traceEvents"]}
        for name, (count, host_ms) in _range_rows((prof / f"core-{k}.txt").read_text()).items():
            before = rows.get(name, (0, 0.0))
            rows[name] = (before[0] + count, before[1] + host_ms)
    # The engine thread's stages and its model's convolutions are in the core's traces.
    assert {"engine.decode", "acoustic.encode", "engine.plan"} <= names
    assert any("convolution" in str(n) for n in names)
    for name in ("engine.decode", "engine.acoustic", "acoustic.encode", "engine.deliver"):
        count, host_ms = rows[name]
        assert count >= 1 and host_ms > 0, name
