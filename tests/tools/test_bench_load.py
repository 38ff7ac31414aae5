"""`cadenza bench load`: the pure parts, then end to end against a real local server."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

if TYPE_CHECKING:
    from tests.api.native_server import ServerThread
from service.cli import main
from service.tools.bench_load import (
    CHARS_PER_AUDIO_S,
    MEAN_SESSION_S,
    POISSON_DURATION_S,
    SessionRecord,
    arrival_times,
    best_probe,
    call_interval,
    concurrency,
    first_sentence_delta,
    mean_session_chars,
    next_probe,
    percentile,
    pick_texts,
    plot_ttfa_cdf,
    poisson_schedule,
    summarise,
    summary_line,
    text_deltas,
    worst_underrun,
)

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
LAST_LINE = r"pass_rate=(\S+) ttfa_p50_ms=(\S+) ttfa_p99_ms=(\S+) sessions=(\d+) rtfx=(\S+)"


def test_on_time_chunks_never_underrun() -> None:
    # 0.5 s chunks, each arriving well before the previous audio has played out
    assert worst_underrun([10.0, 10.1, 10.4, 10.9], [0.5, 0.5, 0.5, 0.5]) == 0.0
    assert worst_underrun([], []) == 0.0
    assert worst_underrun([3.0], [0.2]) == 0.0


def test_a_late_chunk_is_late_against_the_audio_before_it() -> None:
    # 0.2 s of audio from t=1.0 plays out at 1.2; the second chunk comes at 1.35: 150 ms late
    assert worst_underrun([1.0, 1.35], [0.2, 0.2]) == pytest.approx(0.15)
    # the third is due at 1.0 + 0.4 = 1.4 and comes at 1.45: the clock does not wait, so the
    # earlier 150 ms stays the worst
    assert worst_underrun([1.0, 1.35, 1.45], [0.2, 0.2, 1.0]) == pytest.approx(0.15)


def test_underruns_add_up_like_a_player_that_waits() -> None:
    # two 100 ms stalls: chunk 1 due 0.1, comes 0.2; chunk 2 due 0.2, comes 0.4 -> 200 ms behind
    assert worst_underrun([0.0, 0.2, 0.4], [0.1, 0.1, 0.1]) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        worst_underrun([0.0, 1.0], [0.1])


def test_percentile_matches_numpy() -> None:
    values = [random.Random(3).uniform(0, 100) for _ in range(37)]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert np.isnan(percentile([], 50))
    assert percentile([7.0], 99) == 7.0


def _record(ttfa: float | None, underrun: float = 0.0, code: str = "OK", audio: float = 2.0) -> SessionRecord:
    return SessionRecord(index=0, start_s=0.0, end_s=1.0, text="x", ttfa_ms=ttfa, worst_underrun_ms=underrun,
                         audio_seconds=audio, code=code)


def test_summary_and_its_line() -> None:
    records = [_record(40.0), _record(60.0, underrun=100.0), _record(80.0, underrun=100.1),
               _record(None, code="RESOURCE_EXHAUSTED", audio=0.0)]
    s = summarise(records, wall_s=3.0)
    assert (s.sessions, s.passed, s.errors) == (4, 2, 1)
    assert s.ttfa_p50_ms == 60.0 and np.isnan(s.server_ttfa_p50_ms)
    assert summary_line(s) == "pass_rate=0.500 ttfa_p50_ms=60.0 ttfa_p99_ms=79.6 sessions=4 rtfx=2.00"
    none = summarise([_record(None, code="UNAVAILABLE", audio=0.0)], wall_s=1.0)
    assert summary_line(none) == "pass_rate=0.000 ttfa_p50_ms=nan ttfa_p99_ms=nan sessions=1 rtfx=0.00"


def _search(capacity: int, upper: int, start: int = 1) -> tuple[int, list[int]]:
    """Run the sweep against a fake server that passes up to `capacity` sessions."""
    results: dict[int, bool] = {}
    tried = []
    while (n := next_probe(results, upper, start)) is not None:
        assert n not in results
        tried.append(n)
        results[n] = n <= capacity
    return best_probe(results), tried


def test_sweep_doubles_then_bisects() -> None:
    assert _search(37, 256) == (37, [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37])
    assert _search(64, 256) == (64, [1, 2, 4, 8, 16, 32, 64, 128, 96, 80, 72, 68, 66, 65])
    assert _search(1000, 100) == (100, [1, 2, 4, 8, 16, 32, 64, 100])
    assert _search(0, 100) == (0, [1])
    for capacity in range(0, 70):
        assert _search(capacity, 50)[0] == min(capacity, 50)


def test_sweep_from_a_figure_measured_before() -> None:
    """`--sweep-from`: the search starts there (no small probes) and still finds the answer, above
    the start or below it."""
    assert _search(1200, 3000, start=750) == (1200, [750, 1500, 1125, 1312, 1218, 1171, 1194, 1206, 1200, 1203,
                                                     1201])
    assert _search(600, 3000, start=750)[1][:2] == [750, 375]  # the start fails: bisection below it
    for capacity in range(0, 120, 7):
        for start in (1, 5, 64, 200):
            assert _search(capacity, 100, start)[0] == min(capacity, 100)


def test_arrivals_texts_and_pacing_are_deterministic() -> None:
    assert arrival_times("burst", 3, 1.0, None, random.Random(0)) == [0.0, 0.0, 0.0]
    poisson = arrival_times("poisson", 50, 4.0, None, random.Random(5))
    assert poisson == arrival_times("poisson", 50, 4.0, None, random.Random(5))
    assert len(poisson) == 50 and poisson[0] == 0.0 and poisson == sorted(poisson)
    capped = arrival_times("poisson", 1000, 4.0, 3.0, random.Random(5))
    assert 1 < len(capped) < 1000 and max(capped) < 3.0
    assert arrival_times("poisson", None, 4.0, 3.0, random.Random(5)) == capped  # no count cap: the window ends it
    with pytest.raises(ValueError):
        arrival_times("poisson", None, 4.0, None, random.Random(5))
    texts = pick_texts(random.Random(1), 20)
    assert texts == pick_texts(random.Random(1), 20)
    assert all(len(t) in (2, 3) and len(set(t)) == len(t) for t in texts)

    sentences = ["Hello there.", "How can I help you today?"]
    whole = text_deltas(sentences, "sentence", 30.0)
    assert whole == [(0.0, "Hello there."), (0.0, " How can I help you today?")]
    tokens = text_deltas(sentences, "llm", 10.0)
    assert "".join(t for _, t in tokens) == "Hello there. How can I help you today?"
    assert [t for _, t in tokens][:3] == ["Hello", " there.", " How"]
    assert [round(at, 6) for at, _ in tokens] == [k / 10 for k in range(len(tokens))]


def test_poisson_rate_holds_n_sessions_by_littles_law() -> None:
    # a session is 2 or 3 distinct sentences: the expected length matches what pick_texts really picks
    picked = [len(" ".join(t)) for t in pick_texts(random.Random(7), 20_000)]
    assert sum(picked) / len(picked) == pytest.approx(mean_session_chars(), rel=0.01)
    assert MEAN_SESSION_S == pytest.approx(mean_session_chars() / CHARS_PER_AUDIO_S)
    assert 8.0 < MEAN_SESSION_S < 14.0  # 2.5 call-center sentences of ~87 characters
    # N is the target concurrency: rate x mean session length = N, arriving for 30 s with no count cap
    rate, window, cap = poisson_schedule(100, None, None)
    assert rate * MEAN_SESSION_S == pytest.approx(100) and window == POISSON_DURATION_S == 30.0 and cap is None
    assert poisson_schedule(10, None, 5.0) == (pytest.approx(10 / MEAN_SESSION_S), 5.0, None)
    # an explicit rate wins; N then caps the arrivals and the duration stays as given
    assert poisson_schedule(100, 2.0, None) == (2.0, None, 100)
    assert poisson_schedule(100, 2.0, 7.0) == (2.0, 7.0, 100)
    # 60 s at 100 concurrent, ~11 s each: ~550 arrivals
    arrivals = arrival_times("poisson", None, rate, 60.0, random.Random(3))
    assert len(arrivals) == pytest.approx(60 * rate, rel=0.15)


def test_concurrency_over_a_hand_made_timeline() -> None:
    #   0    1    2    3    4    5
    #   [-------------------)          a
    #        [----)                    b
    #             [-------------)      c   (starts as b ends: no overlap with b)
    #                  [--)            d
    intervals = [(0.0, 4.0), (1.0, 2.0), (2.0, 5.0), (3.0, 3.5)]
    mean, peak = concurrency(intervals, window_s=4.0)
    assert mean == pytest.approx((4 + 1 + 2 + 0.5) / 4) and peak == 3
    assert concurrency(intervals, window_s=5.0)[0] == pytest.approx((4 + 1 + 3 + 0.5) / 5)
    assert concurrency([], 1.0) == (0.0, 0)
    assert np.isnan(concurrency([(0.0, 1.0)], 0.0)[0])
    # a call lasts until its audio has played from the first chunk, or its stream ended if that is later
    played = SessionRecord(index=0, start_s=0.5, end_s=2.0, text="x", ttfa_ms=50.0, first_audio_s=0.6,
                           audio_seconds=3.0)
    assert call_interval(played) == (0.5, pytest.approx(3.6))
    assert call_interval(_record(None, code="UNAVAILABLE", audio=0.0)) == (0.0, 1.0)
    s = summarise([played, _record(40.0)], wall_s=4.0, target_concurrency=2.0, arrival_rate=0.5)
    assert (s.open_mean, s.open_peak) == (pytest.approx((1.5 + 1) / 4), 2)  # [0.5, 2) and [0, 1) over 4 s
    assert (s.calls_mean, s.calls_peak) == (pytest.approx((3.1 + 1) / 4), 2)  # [0.5, 3.6) and [0, 1)
    assert summarise([played], wall_s=4.0, window_s=2.0).open_mean == pytest.approx(1.5 / 2)
    assert (s.target_concurrency, s.arrival_rate_per_s) == (2.0, 0.5)


def test_llm_ttfa_starts_when_the_first_sentence_is_complete() -> None:
    sentences = ["Hello there.", "How can I help you today?"]
    tokens = text_deltas(sentences, "llm", 10.0)
    ref = first_sentence_delta(tokens, sentences[0])
    assert ref == 1 and tokens[ref] == (pytest.approx(0.1), " there.")  # sent 100 ms after the first token
    long = ["I can see that your last payment was received on the fourteenth of March.", "Thanks."]
    tokens = text_deltas(long, "llm", 30.0)
    ref = first_sentence_delta(tokens, long[0])
    assert "".join(t for _, t in tokens[:ref + 1]) == long[0] and tokens[ref][1] == " March."
    assert tokens[ref][0] == pytest.approx(13 / 30)  # the 14th word: TTFA from the first token would add 433 ms
    # sentence pacing: the first delta is the whole first sentence, so both TTFA figures are the same
    assert first_sentence_delta(text_deltas(long, "sentence", 30.0), long[0]) == 0


def test_missing_matplotlib_skips_the_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert plot_ttfa_cdf(tmp_path / "x.png", [("3 sessions", [1.0, 2.0])], 150.0) is False
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    """The tiny test voice on CPU, as tests/api does (imported here: the pure tests need no engine)."""
    from service.api.server import ServerConfig
    from service.engine.config import EngineConfig, Limits
    from tests.api.native_server import ServerThread

    s = ServerThread(ServerConfig(
        host="127.0.0.1", port=0,
        engine=EngineConfig(voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu", threads=1,
                            cache_bytes=0, limits=Limits(max_sessions=16)),
    ))
    yield s
    s.close()


def test_burst_against_a_real_server(server: ServerThread, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    import re

    out, png = tmp_path / "load.json", tmp_path / "load.png"
    assert main(["bench", "load", "--target", server.addr, "--sessions", "3", "--arrival", "burst",
                 "--json", str(out), "--png", str(png), "--seed", "2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(LAST_LINE, last)
    assert m, last
    pass_rate, p50, p99, sessions, rtfx = (float(g) for g in m.groups())
    assert sessions == 3 and 0.0 <= pass_rate <= 1.0 and 0 < p50 <= p99 and rtfx > 0
    report = json.loads(out.read_text())
    assert report["summary"]["sessions"] == 3 and report["summary"]["errors"] == 0
    assert len(report["sessions"]) == 3
    for record in report["sessions"]:
        assert record["code"] == "OK" and record["ttfa_ms"] > 0 and record["audio_seconds"] > 0
        assert record["ttfa_ms"] >= record["server_ttfa_ms"] - 1.0  # the client's span holds the server's
        assert len(record["gaps_ms"]) == record["chunks"] - 1 and record["worst_underrun_ms"] >= 0
    assert png.stat().st_size > 5_000


def test_llm_pacing_and_a_small_sweep(server: ServerThread, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep.json"
    assert main(["bench", "load", "--target", server.addr, "--sessions", "2", "--pace", "llm",
                 "--tokens-per-s", "200", "--sweep", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("probe N=1: pass_rate=") for line in lines)
    assert lines[-1].startswith("pass_rate=")
    report = json.loads(out.read_text())
    assert report["sweep"]["probes"][0]["n"] == 1
    for r in report["sessions"]:
        assert r["code"] == "OK"
        # the headline is measured from the first sentence's last token: never more than from the first token
        assert 0 <= r["ttfa_ms"] <= r["ttfa_from_first_text_ms"]


def test_the_sweeps_p99_limit_is_an_option(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    """`--sweep-p99-ms`: an LLM-based voice is judged at its own limit; one no session can meet
    fails every probe, and a limit that is not a positive number is refused before any load."""
    assert main(["bench", "load", "--target", server.addr, "--sessions", "2", "--sweep",
                 "--sweep-p99-ms", "0.001"]) == 0
    out = capsys.readouterr().out
    assert "probe N=1: pass_rate=1.000" in out and "-> fail" in out and "-> pass" not in out
    assert "ttfa_p99 <= 0.001 ms: none" in out
    assert main(["bench", "load", "--target", server.addr, "--sweep", "--sweep-p99-ms", "0"]) == 1
    assert "--sweep-p99-ms must be positive" in capsys.readouterr().err


def test_poisson_at_a_target_concurrency(server: ServerThread, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    import re

    out = tmp_path / "poisson.json"
    assert main(["bench", "load", "--target", server.addr, "--sessions", "3", "--arrival", "poisson",
                 "--duration", "3", "--seed", "1", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    m = re.fullmatch(LAST_LINE, lines[-1])
    assert m, lines[-1]
    assert any("at target concurrency 3, poisson" in line for line in lines)
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["target_concurrency"] == 3
    assert summary["arrival_rate_per_s"] == pytest.approx(3 / MEAN_SESSION_S)
    assert summary["sessions"] == int(m.group(4)) == len(report["sessions"]) >= 1
    assert summary["open_peak"] >= 1 and summary["calls_peak"] >= summary["open_peak"]
    assert summary["calls_mean"] > 0 and summary["errors"] == 0
    assert all(r["start_s"] < 3.0 for r in report["sessions"])  # arrivals stop after --duration


def test_unreachable_target_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "bench", "load", "--target", f"127.0.0.1:{port}",
         "--connect-timeout", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 1
    assert f"cadenza: error: cannot reach 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr


def test_no_server_listening_fails_within_seconds_by_default() -> None:
    """Without --connect-timeout a server must be listening already: a wrong port or a server not
    started is a one-line error after a short connection attempt, not after the start-up wait."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    done = subprocess.run([sys.executable, "-m", "service.cli", "bench", "load", "--target", f"127.0.0.1:{port}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"cadenza: error: no server at 127.0.0.1:{port}: start one with `cadenza serve` "
                                   "(or give --connect-timeout SECONDS to wait for one that is starting)")


def test_sessions_spread_over_client_processes(server: ServerThread, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--procs deals the sessions round-robin over client processes that start together; the
    report has every session once, as from one process."""
    out = tmp_path / "procs.json"
    assert main(["bench", "load", "--target", server.addr, "--sessions", "3", "--arrival", "burst",
                 "--procs", "2", "--seed", "2", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "2 client processes" in lines[0]
    report = json.loads(out.read_text())
    assert report["config"]["procs"] == 2 and report["summary"]["sessions"] == 3
    assert [r["index"] for r in report["sessions"]] == [0, 1, 2]
    assert report["summary"]["errors"] == 0 and report["summary"]["wall_s"] > 0
    for record in report["sessions"]:
        assert record["code"] == "OK" and record["ttfa_ms"] > 0 and 0 <= record["start_s"] < 1.0
    # the same sessions (texts and arrivals come from the seed) as one process would run
    one = tmp_path / "one.json"
    assert main(["bench", "load", "--target", server.addr, "--sessions", "3", "--arrival", "burst",
                 "--seed", "2", "--json", str(one)]) == 0
    assert [r["text"] for r in json.loads(one.read_text())["sessions"]] == [r["text"] for r in report["sessions"]]


def test_one_connection_per_session(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "load", "--target", server.addr, "--sessions", "3", "--sessions-per-channel", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].endswith("3 channel(s)") and "sessions=3" in lines[-1] and ", 0 errors," in lines[-2]
