"""Log lines stay lines: a client's text cannot forge one (text and JSON formats), JSON mode
makes every line on stderr JSON (warnings, C code's writes to fd 2, a crash's last words),
and the event counters are on /metrics at 0 before their first event. Real `cadenza serve`
processes where a server is involved."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.api.client import connect, stream
from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.telemetry.logs import JsonFormatter, TextFormatter, one_line
from tests.serve_process import json_lines, start_serve, stop_process
from tests.telemetry.conftest import DATA, TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
FORGED = "2026-01-01 00:00:00,000 CRITICAL service.api.server: FORGED LINE"
SERVE = ("--voices", str(DATA), "--voice", "tiny-multi", "--backend", "torch", "--device", "cpu", "--threads", "1")




@contextmanager
def serving(log: Path, *args: str) -> Iterator[int]:
    """`cadenza serve` (the tiny voice) with its stderr in `log`: its port. Stopped (SIGTERM) at
    the end, so `log` is complete afterwards."""
    with log.open("w") as out:
        try:
            server, port = start_serve(*SERVE, *args, stderr=out)
        except AssertionError:
            raise AssertionError(log.read_text()) from None
        try:
            yield port
        finally:
            stop_process(server)


# --- formatters ---------------------------------------------------------------------------------------


def _record(message: str, *args: object, exc: bool = False, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("service.test", logging.INFO, __file__, 1, message, args or None, None)
    if exc:
        try:
            raise ValueError(f"bad voice x\n{FORGED}")
        except ValueError:
            record.exc_info = sys.exc_info()
    record.__dict__.update(extra)
    return record


@pytest.mark.parametrize("char", ["\n", "\r", "\x00", "\x1b", "\x7f", "\x85", "\u2028", "\u2029", "\t"])
def test_one_line_escapes_every_line_breaker(char: str) -> None:
    escaped = one_line(f"a{char}b")
    assert escaped.startswith("a\\") and escaped.endswith("b") and len(escaped.splitlines()) == 1
    assert one_line("non-ASCII stays: é 中文") == "non-ASCII stays: é 中文"


def test_text_formatter_keeps_client_text_off_the_start_of_a_line() -> None:
    line = TextFormatter().format(_record("session end: request_id=%s", f"x\r\n{FORGED}\u2028{FORGED}"))
    assert len(line.splitlines()) == 1 and f"\\r\\n{FORGED}\\u2028{FORGED}" in line
    # A traceback stays readable on several lines, indented: the exception's message cannot start one.
    lines = TextFormatter().format(_record("failed", exc=True)).split("\n")
    assert len(lines) > 3 and lines[1] == "  Traceback (most recent call last):"
    assert all(line.startswith("  ") for line in lines[1:])
    assert not any(line.startswith(FORGED) for line in lines)


def test_json_formatter_escapes_the_message_and_extra_fields() -> None:
    text = JsonFormatter().format(_record("voice %s", f"v\n{FORGED}", exc=True, request_id=f"r\u2028{FORGED}",
                                          count=3))
    assert len(text.splitlines()) == 1 and "\u2028" not in text
    record = json.loads(text)
    assert record["message"] == f"voice v\\n{FORGED}"
    assert record["request_id"] == f"r\\u2028{FORGED}" and record["count"] == 3
    assert record["exception"].startswith("Traceback") and FORGED in record["exception"]


# --- JSON mode's stderr, without a server ------------------------------------------------------------

_CRASHING = """
import logging, os, signal, warnings
from service.telemetry.config import LogConfig
from service.telemetry.logs import relay_stderr, setup_logging
relay_stderr()
setup_logging(LogConfig(format="json"))
logging.getLogger("service.test").warning("a record")
warnings.warn("a warning\\non two lines")
os.write(2, b"I1203 08:41:27.961142    5625 ssl_transport_security.cc:2563] Handshake failed\\n")
os.write(2, b"raw C text\\n" + "FORGED\\u2028".encode() + b"\\n")
os.write(2, b"the last words, without a newline")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_json_stderr_relay_makes_every_line_json_and_outlives_a_crash() -> None:
    done = subprocess.run([sys.executable, "-c", _CRASHING], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == -signal.SIGKILL
    records = json_lines(done.stderr)
    by_message = {str(r["message"]): r for r in records}
    assert by_message["a record"]["logger"] == "service.test"
    (warning,) = [r for r in records if r["logger"] == "py.warnings"]
    assert "a warning\\non two lines" in str(warning["message"])
    handshake = next(r for m, r in by_message.items() if "Handshake failed" in m)
    assert handshake["level"] == "INFO" and handshake["logger"] == "stderr"
    assert {"raw C text", "FORGED\u2028", "the last words, without a newline"} <= set(by_message)


# --- real servers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_client_fields_cannot_forge_a_log_line(tmp_path: Path, log_format: str) -> None:
    log = tmp_path / "serve.log"
    with serving(log, "--log-format", log_format) as port:
        channel, stub = connect(f"127.0.0.1:{port}")
        try:
            result = stream(stub, pb.SessionConfig(seed=1, request_id=f"req\n{FORGED}"), ["Hello there."],
                            timeout=TIMEOUT_S)
            assert result.summary is not None
            with pytest.raises(grpc.RpcError) as err:
                stream(stub, pb.SessionConfig(voice=f"nobody\n{FORGED}"), ["Hello."], timeout=TIMEOUT_S)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            channel.close()
    text = log.read_text()
    assert "FORGED LINE" in text  # the fields were logged, escaped
    assert not any(line.startswith(FORGED) for line in text.splitlines()), text
    if log_format == "json":
        records = json_lines(text)
        (end,) = [r for r in records if str(r.get("request_id", "")).startswith("req")]
        assert end["request_id"] == f"req\\n{FORGED}"
    else:
        assert f"request_id=req\\n{FORGED}" in text


def test_event_counters_are_on_metrics_at_zero_from_the_start(tmp_path: Path) -> None:
    """Before any session or guard trip: dashboards read 0, not "no data"."""
    log = tmp_path / "serve.log"
    with serving(log, "--metrics-port", "0"):
        (url,) = [word for word in log.read_text().split() if word.endswith("/metrics")]
        with urllib.request.urlopen(url, timeout=10) as response:
            scraped = response.read().decode()
    samples = {(s.name, frozenset((k, v) for k, v in s.labels.items() if not k.startswith("otel_scope_"))): s.value
               for family in text_string_to_metric_families(scraped) for s in family.samples}
    voice = {"cadenza_voice": "tiny-multi"}
    for name, labels in (
        ("cadenza_guard_fp32_fallbacks_total", {**voice, "stage": "decoder"}),
        ("cadenza_guard_trips_total", {**voice, "stage": "decoder", "cadenza_precision": "fp16"}),
        ("cadenza_guard_trips_total", {**voice, "stage": "decoder", "cadenza_precision": "fp32"}),
        ("cadenza_session_underruns_total", {**voice, "cadenza_precision": "fp16"}),
        ("cadenza_sessions_active", voice),
        ("cadenza_sessions_admitted_total", {}),
        ("cadenza_sessions_rejected_total", {"reason": "capacity"}),
        ("cadenza_sessions_rejected_total", {"reason": "max_sessions"}),
    ):
        assert samples.get((name, frozenset(labels.items()))) == 0.0, f"{name}{labels} missing:\n{scraped}"
