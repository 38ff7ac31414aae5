"""`serve --timeline`: the recorder, and its summary over a real server's files."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from service.cli import main
from service.telemetry.timeline import Timeline
from service.telemetry.timeline_summary import CLIENT_STAGES, STAGES, load, session_paths

DATA = Path(__file__).resolve().parents[1] / "data"


def test_off_without_a_directory() -> None:
    timeline = Timeline()
    timeline.add("plan", sessions=1)
    with timeline.timed("acoustic") as fields:
        fields["sentences"] = 2
    assert not timeline.on and timeline.flush() is None


def test_periods_are_files_of_json_lines(tmp_path: Path) -> None:
    timeline = Timeline(tmp_path / "tl", "core")
    before = time.monotonic()
    timeline.add("open", sid=3)
    with timeline.timed("launch", rows=2) as fields:
        fields["frames"] = 64
        sum(range(100_000))  # some CPU for the thread's clock
    first = timeline.flush()
    assert first is not None and first.name.endswith("-1.jsonl") and first.name.startswith("core-")
    events = [json.loads(line) for line in first.read_text().splitlines()]
    assert [e["k"] for e in events] == ["open", "launch"]
    launch = events[1]
    assert launch["rows"] == 2 and launch["frames"] == 64
    assert before <= events[0]["t"] <= launch["s"] <= launch["t"]
    assert 0 < launch["cpu"] <= launch["t"] - launch["s"] + 0.01
    assert timeline.flush() is None  # nothing new: no file
    timeline.add("open", sid=4)
    second = timeline.flush()
    assert second is not None and second.name.endswith("-2.jsonl")


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists(), reason="Linux schedstat")
def test_timed_calls_count_the_time_a_thread_waited_for_a_cpu(tmp_path: Path) -> None:
    """With more busy processes than CPUs, a spinning thread is runnable but off a CPU part of
    the time: `ready` says how long, and CPU plus that stays within the wall time."""
    timeline = Timeline(tmp_path, "core")
    ctx = multiprocessing.get_context("spawn")
    burners = [ctx.Process(target=_burn, args=(3.0,)) for _ in range((os.cpu_count() or 1) + 1)]
    for p in burners:
        p.start()
    try:
        time.sleep(0.5)  # the burners are running
        with timeline.timed("launch"):
            _burn(0.5)
    finally:
        for p in burners:
            p.terminate()
            p.join()
    path = timeline.flush()
    assert path is not None
    (launch,) = [json.loads(line) for line in path.read_text().splitlines()]
    wall = launch["t"] - launch["s"]
    assert launch["ready"] > 0.05
    assert launch["cpu"] + launch["ready"] <= wall + 0.02


def test_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Timeline, "MAX_EVENTS", 3)
    monkeypatch.setattr(Timeline, "MAX_PERIODS", 1)
    timeline = Timeline(tmp_path, "api")
    for sid in range(5):
        timeline.add("text_in", sid=sid)
    path = timeline.flush()
    assert path is not None
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["k"] for e in events] == ["text_in"] * 3 + ["dropped"] and events[-1]["n"] == 2
    timeline.add("text_in", sid=9)  # past MAX_PERIODS: off
    assert not timeline.on and timeline.flush() is None


def test_an_unwritable_directory_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    timeline = Timeline(blocker / "sub", "core")
    timeline.add("open", sid=1)
    with caplog.at_level(logging.WARNING):
        assert timeline.flush() is None
    assert "cannot write the timeline" in caplog.text


def test_a_real_server_s_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Sessions through a real server (core in its own process, as served) from `bench load
    --timeline` into the same directory: every client session of the burst is in the summary,
    its stages follow each other and add up to its server-side time to first audio, and with
    the client's two legs to the client's own; the engine thread's calls are there."""
    from service.api.server import ServerConfig
    from service.engine.config import EngineConfig, Limits
    from tests.api.native_server import ServerThread

    directory = tmp_path / "tl"
    server = ServerThread(ServerConfig(
        host="127.0.0.1", port=0,
        engine=EngineConfig(limits=Limits(max_sessions=16),
                            voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu", threads=1,
                            cache_bytes=0, timeline_dir=directory),
    ))
    try:
        assert main(["bench", "load", "--target", server.addr, "--sessions", "3", "--arrival", "burst",
                     "--timeline", str(directory)]) == 0
    finally:
        server.close()
    capsys.readouterr()
    recorded = load(directory)
    assert recorded.periods and len(recorded.api) == 3  # the warm-up sessions are not the server's clients
    assert sorted(recorded.client) == [f"bench-load-{i}" for i in range(3)]
    paths = [p for _, events in recorded.periods for p in session_paths(events, recorded)]
    assert sorted(p.sid for p in paths) == sorted(recorded.api)
    for p in paths:
        assert set(p.stages) == set(STAGES)
        assert sum(p.stages.values()) == pytest.approx(p.ttfa_s, abs=1e-6)  # no stage negative, none missing
        assert p.client is not None and all(p.client[name] >= 0 for name in CLIENT_STAGES)
        legs = p.client["client to server"] + p.ttfa_s + p.client["server to client"]
        assert legs == pytest.approx(p.client["client TTFA"], abs=1e-6)
    assert main(["timeline", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "3 sessions; first text in to last first audio out" in out
    for name in (*CLIENT_STAGES, *STAGES, "server TTFA", "client TTFA", "acoustic calls", "step launches",
                 "step results"):  # torch on CPU: slot steps
        assert name in out


def test_the_command_says_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline", str(tmp_path)]) == 0
    assert "no client sessions" in capsys.readouterr().out
    assert main(["timeline", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_collections_are_recorded(tmp_path: Path) -> None:
    import gc

    timeline = Timeline(tmp_path, "core")
    timeline.watch_gc()
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(timeline._gc)
    path = timeline.flush()
    assert path is not None
    events = [json.loads(line) for line in path.read_text().splitlines()]
    full = [e for e in events if e["k"] == "gc" and e["generation"] == 2]
    assert full and full[0]["s"] <= full[0]["t"] and full[0]["collected"] >= 0


def test_summary_of_a_hand_made_period() -> None:
    """Two sessions' marks, the engine thread's calls and the collections of both processes:
    each stage is the gap between two marks, and only what falls in the window is counted."""
    from service.telemetry.timeline_summary import Recorded, summarise

    def first(sid: int, base: float) -> list[dict[str, object]]:
        return [
            {"t": base + 0.004, "k": "text", "sid": sid, "seq": 0, "sentences": 1, "sent": base + 0.002,
             "phonemized": base + 0.003},
            {"t": base + 0.040, "k": "first_audio", "sid": sid, "sent": base + 0.002, "phonemized": base + 0.003,
             "acoustic_start": base + 0.010, "acoustic_end": base + 0.020, "step_start": base + 0.025},
        ]

    core = [*first(1, 10.0), *first(2, 10.1),
            {"t": 10.020, "k": "acoustic", "s": 10.010, "cpu": 0.004, "sentences": 1, "first": 1},
            {"t": 10.024, "k": "tokens", "s": 10.021, "cpu": 0.001, "rows": 2},
            {"t": 10.030, "k": "launch", "s": 10.025, "cpu": 0.002, "ready": 0.001, "rows": 2, "first": True,
             "frames": 77},
            {"t": 10.031, "k": "gc", "s": 10.030, "generation": 2, "collected": 5},
            {"t": 99.0, "k": "gc", "s": 98.0, "generation": 2, "collected": 0}]  # outside the window
    api = {1: {"text_in": 10.001, "audio_out": 10.045}, 2: {"text_in": 10.101, "audio_out": 10.145}}
    recorded = Recorded([], api, {}, {}, [{"t": 10.05, "k": "gc", "s": 10.049, "generation": 0}],
                        [{"t": 10.06, "k": "loop_lag", "s": 10.05, "lag": 0.010},
                         {"t": 10.09, "k": "loop_lag", "s": 10.085, "lag": 0.004},
                         {"t": 99.0, "k": "loop_lag", "s": 98.9, "lag": 0.1}])  # the last outside the window
    lines = summarise(core, recorded)
    assert lines[0].startswith("2 sessions; first text in to last first audio out: 144.0 ms")
    rows = {line.split("  ")[1].strip(): line.split()[-5:] for line in lines[2:12] if line.startswith("  ")}
    assert rows["to the core"] == ["1.0"] * 5 and rows["acoustic"] == ["10.0"] * 5
    assert rows["wait for a step"] == ["5.0"] * 5 and rows["server TTFA"] == ["44.0"] * 5
    assert any("acoustic calls" in line and "wall    10.0 ms" in line for line in lines)
    # how a burst's sessions came in: their first texts reached the server 100 ms apart
    assert "the server took their first texts in over 100.0 ms (from one to the next: p50 100.00 ms, " \
           "longest 100.0 ms)" in lines
    assert any("token steps" in line and "2.0 rows" in line and "wall     3.0 ms" in line for line in lines)
    assert any("step launches" in line and "CPU     2.0 ms, waiting for a CPU     1.0 ms" in line for line in lines)
    assert "garbage collections in the core process: 1 (1 full), 1.0 ms in all, longest 1.0 ms" in lines
    assert "garbage collections in the server process: 1 (0 full), 1.0 ms in all, longest 1.0 ms" in lines
    assert "server event loop: late by more than 2 ms 2 times, 14.0 ms in all, longest 10.0 ms" in lines


def test_the_server_records_when_its_event_loop_was_late(tmp_path: Path) -> None:
    """With --timeline, a loop held up while a client session is open (here: 80 ms of blocking
    work on it) leaves a `loop_lag` event about that long in the server's timeline."""
    import asyncio

    from service.engine.config import EngineConfig
    from service.engine.contract import SessionConfig
    from service.engine.engine import TtsEngine

    async def blocked() -> None:
        engine = TtsEngine(EngineConfig(voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu",
                                        threads=1, cache_bytes=0, core="thread", timeline_dir=tmp_path))
        await engine.start()
        try:
            session = await engine.open_session(SessionConfig())
            await asyncio.sleep(0.02)
            time.sleep(0.08)  # the loop is busy: nothing else runs on it meanwhile
            await asyncio.sleep(0.02)
            session.cancel()
            engine.timeline.flush()
        finally:
            await engine.stop()

    asyncio.run(blocked())
    lags = [json.loads(line) for p in tmp_path.glob("api-*.jsonl") for line in p.read_text().splitlines()]
    lags = [e for e in lags if e["k"] == "loop_lag"]
    assert lags and 0.06 <= max(e["lag"] for e in lags) <= 0.5


def test_a_busy_period_cut_by_a_stop_is_written(tmp_path: Path) -> None:
    """A server stopped under load (SIGTERM while sessions still speak) keeps the core's timeline
    of that busy period: the overload one would want to look at afterwards."""
    import asyncio

    from service.engine.cache import ResultCache
    from service.engine.config import BatchConfig
    from service.engine.core import EngineCore
    from service.engine.frontend_pool import FrontendPoolConfig
    from service.engine.state import ReadCursor, WorkSpec
    from service.models.family import ChunkSchedule, SynthesisParams
    from service.models.registry import open_voice
    from service.voices import builtin_voice_info

    class Sink:
        def on_chunk(self, chunk: object) -> None: ...

        def on_done(self) -> None: ...

        def on_error(self, exc: BaseException) -> None: ...

    loop = asyncio.new_event_loop()
    core = EngineCore(BatchConfig(), ResultCache(0), frontend=FrontendPoolConfig(workers=0),
                      timeline=Timeline(tmp_path, "core"))
    core.start()
    spec = WorkSpec(1, "joe", None, SynthesisParams(), ChunkSchedule(), "fp32", None,
                    runtime=open_voice(builtin_voice_info(), "onnxruntime", "cpu", threads=1), sink=Sink(),
                    loop=loop, cursor=ReadCursor())
    core.submit_open(spec)
    core.submit_text(1, "A session that is still open when the server stops. " * 20)  # never ended
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(e[1] == "plan" for e in core.timeline._events):
        time.sleep(0.01)
    core.stop()
    loop.close()
    files = sorted(tmp_path.glob("core-*.jsonl"))
    assert files, "the period in progress was not written"
    kinds = {json.loads(line)["k"] for f in files for line in f.read_text().splitlines()}
    assert {"open", "text", "plan"} <= kinds
