"""The profile summary's arithmetic on a small hand-made Chrome trace (the GPU's own traces are
summarised on the GPU host; on CPU, tests/tools/test_bench_streams.py covers a real one)."""

from __future__ import annotations

from service.telemetry.trace_summary import summarise


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, corr: int | None = None) -> dict[str, object]:
    event: dict[str, object] = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    if corr is not None:
        event["args"] = {"correlation": corr}
    return event


def test_device_time_is_charged_to_the_range_that_launched_it() -> None:
    events = [
        # Two steps on the engine thread (tid 1): each launches a graph whose two kernels run later.
        _x("user_annotation", "step.launch", 0, 100),
        _x("cuda_runtime", "cudaGraphLaunch", 10, 50, corr=7),
        _x("kernel", "k_a", 200, 300, tid=7, corr=7),
        _x("kernel", "k_b", 600, 100, tid=7, corr=7),
        _x("user_annotation", "step.launch", 1000, 100),
        _x("cuda_runtime", "cudaGraphLaunch", 1010, 50, corr=9),
        _x("kernel", "k_a", 1100, 300, tid=7, corr=9),
        _x("kernel", "k_b", 1400, 100, tid=7, corr=9),
        # A launch on another thread inside the range's time is not the range's.
        _x("cuda_runtime", "cudaLaunchKernel", 1020, 5, tid=2, corr=11),
        _x("kernel", "k_c", 1600, 400, tid=7, corr=11),
        _x("user_annotation", "step.wait", 100, 600),
    ]
    lines = summarise({"traceEvents": events})
    assert lines[0] == "window 2.0 ms, 5 device ops, 3 engine ranges"
    # Busy: 200-500, 600-700, 1100-1500, 1600-2000 = 1.2 ms of 2.0 ms.
    assert lines[1].startswith("device busy 1.2 ms (60% of the window); summed device op time 1.2 ms")
    row = next(line for line in lines if line.startswith("step.launch")).split()
    # count 2, host 0.2 ms, mean 0.1, p90 0.1; device 0.4 ms per launch, span (0.5 + 0.4)/2, done after (0.7 + 0.5)/2.
    assert row[1:] == ["2", "0.2", "0.10", "0.10", "0.40", "0.45", "0.60"]
    wait = next(line for line in lines if line.startswith("step.wait")).split()
    assert wait[1:5] == ["1", "0.6", "0.60", "0.60"] and wait[5] == "0.00"
    kernels = lines[lines.index(next(line for line in lines if line.endswith("device op"))) + 1:]
    assert kernels[0].split()[-1] == "k_a" and kernels[0].split()[:3] == ["0.6", "50.0%", "2"]
