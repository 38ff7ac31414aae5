"""`cadenza bench streams --profile`: real rounds through the engine on CPU, the core (in its own
process) recording each round's busy period."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.bench_streams import run_streams_bench


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
    # The warm-up round and the measured one; the server's own warm-up sessions are not recorded.
    assert sorted(p.name for p in prof.iterdir()) == ["core-1.json", "core-1.txt", "core-2.json", "core-2.txt"]
    trace = json.loads((prof / "core-2.json").read_text())
    # The engine thread's stages and its model's convolutions are in the core's trace.
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"engine.decode", "acoustic.encode", "engine.plan"} <= names
    assert any("convolution" in str(n) for n in names)
    rows = _range_rows((prof / "core-2.txt").read_text())
    for name in ("engine.decode", "engine.acoustic", "acoustic.encode", "engine.deliver"):
        count, host_ms = rows[name]
        assert count >= 1 and host_ms > 0, name
