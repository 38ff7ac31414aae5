"""A real Prometheus scrapes `cadenza serve --metrics-port` (a real server process) and its
HTTP API answers with the time-to-first-audio histogram and the active-sessions gauge."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.api.client import connect, stream
from service.api.gen.cadenza.v1 import tts_pb2 as pb
from tests.serve_process import start_serve, stop_process
from tests.telemetry.conftest import DATA, TIMEOUT_S, HeldStream

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="the prometheus binary is not installed (Debian: apt-get install prometheus; "
                               ".ci/run installs it)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])




@pytest.fixture
def serve(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """`cadenza serve` with the tiny voice: (gRPC port, metrics port)."""
    metrics_port = _free_port()
    log = (tmp_path / "serve.log").open("w")
    try:
        server, port = start_serve("--voices", str(DATA), "--voice", "tiny-multi", "--backend", "torch", "--device",
                                   "cpu", "--threads", "1", "--metrics-port", str(metrics_port), stderr=log)
    except AssertionError:
        log.close()
        raise AssertionError((tmp_path / "serve.log").read_text()) from None
    try:
        yield port, metrics_port
    finally:
        stop_process(server)
        log.close()


@pytest.fixture
def prometheus(tmp_path: Path, serve: tuple[int, int]) -> Iterator[str]:
    """A Prometheus scraping the server's metrics endpoint every second: its base URL."""
    assert PROMETHEUS is not None
    _, metrics_port = serve
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: cadenza\n    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n")
    port = _free_port()
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.2)
        yield url
    finally:
        stop_process(process)
        log.close()


def _query(url: str, promql: str) -> float | None:
    """The instant value of a PromQL expression that yields one series (None: no data yet)."""
    query = urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(f"{url}/api/v1/query?{query}", timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def _wait_for(url: str, promql: str, expected: float, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = _query(url, promql)
        if value == expected:
            return
        time.sleep(0.5)
    raise AssertionError(f"{promql} = {value}, expected {expected}")


def test_prometheus_scrapes_ttfa_and_active_sessions(serve: tuple[int, int], prometheus: str) -> None:
    port, _ = serve
    channel, stub = connect(f"127.0.0.1:{port}")
    try:
        for seed in (1, 2):
            result = stream(stub, pb.SessionConfig(seed=seed), ["Scraped by a real Prometheus."], timeout=TIMEOUT_S)
            assert result.summary is not None and result.summary.ttfa_seconds > 0
        held = HeldStream(stub)
        try:
            assert held.first_audio.wait(TIMEOUT_S) and held.error is None
            _wait_for(prometheus, "sum(cadenza_sessions_active)", 1.0)
            _wait_for(prometheus, "sum(cadenza_session_time_to_first_audio_seconds_count)", 3.0)
            assert _query(prometheus, 'sum(cadenza_session_time_to_first_audio_seconds_bucket{le="+Inf"})') == 3.0
            p50 = _query(prometheus, "histogram_quantile(0.5, sum by (le) "
                                     "(cadenza_session_time_to_first_audio_seconds_bucket))")
            assert p50 is not None and 0 < p50 < 10
        finally:
            held.release()
        assert held.error is None
        _wait_for(prometheus, "sum(cadenza_sessions_active)", 0.0)
        # The held session's first audio was counted when it came, not again when the session ended.
        assert _query(prometheus, "sum(cadenza_session_time_to_first_audio_seconds_count)") == 3.0
        # Where first audio went counts the same sessions: not the server's warm-up ones (whose
        # first audio waits for the start-up's captures).
        assert _query(prometheus, 'sum(cadenza_session_first_audio_stage_seconds_count{stage="frontend"})') == 3.0
        assert _query(prometheus, "sum(cadenza_sessions_admitted_total)") == 3.0
        assert _query(prometheus, 'up{job="cadenza"}') == 1.0
    finally:
        channel.close()
