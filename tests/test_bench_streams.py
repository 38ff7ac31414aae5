"""`cadenza bench streams --profile`: a real profiled round through the engine on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.bench_streams import run_streams_bench


def test_profile_records_the_engine_threads_ops(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_streams_bench("cpu", "torch", [1], ["fp32"], profile_dir=tmp_path / "prof") == 0
    out = capsys.readouterr().out
    trace = tmp_path / "prof" / "trace-1-fp32.json"
    assert json.loads(trace.read_text())["traceEvents"]
    table = out[out.index("profile 1-fp32:"):].splitlines()
    assert table[1].startswith("CPU time in ops:") and not table[1].startswith("CPU time in ops: 0.0 ms")
    # The decoder's convolutions run on the engine's thread, not this one: they are in the table.
    assert any("convolution" in line for line in table[3:18])
    assert "1/1" in out  # the round itself passed
