"""Server logging: level, text or JSON lines, trace and span ids in JSON records.

Every record is one line whatever the caller sent: the formatters escape control characters in
the message and the extra fields, so no call site can forget to (a request id with a newline in
it must not forge a log line). With JSON lines, `relay_stderr` turns what C code writes to fd 2
into JSON records as well."""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from opentelemetry import trace

from service.telemetry.config import LogConfig

# LogRecord attributes that are not extra fields.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
WITHHELD = "[withheld: it quotes the caller's text; run the server with --log-text to log it]"

# What could end a line or fake one for some reader: C0 and C1 controls, DEL, and Unicode's line
# and paragraph separators (str.splitlines splits at several of them).
_UNSAFE = [*range(0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029]
_ESCAPES = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" for c in _UNSAFE} | {
    ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"}
# json.dumps escapes C0 itself; these it leaves raw (inside JSON strings, where \uXXXX means the same).
_JSON_ESCAPES = {c: f"\\u{c:04x}" for c in _UNSAFE if c >= 0x7F}
TRACEBACK_INDENT = "  "  # a traceback's lines follow their record indented: none can start a line

# Logging is configured once per process, and so is this: whether a log line may quote the
# caller's text (off unless `setup_logging` is given LogConfig(text=True)).
_log_text = False
_active: LogConfig | None = None  # what setup_logging was last given (a child process repeats it)


def allow_text(allowed: bool) -> None:
    """Let log lines quote the caller's text (--log-text) or not (the default)."""
    global _log_text
    _log_text = allowed


def redact(message: str) -> str:
    """`message` where the caller's text may be logged, else a placeholder saying why not."""
    return message if _log_text else WITHHELD


def one_line(text: str) -> str:
    """`text` with its control characters escaped (a trailing newline dropped: warnings end with one)."""
    return text.rstrip("\r\n").translate(_ESCAPES)


def _indented(text: str) -> str:
    return "\n".join(TRACEBACK_INDENT + one_line(line) for line in text.rstrip("\n").split("\n"))


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT on one line. A traceback follows on indented lines, so no text it quotes (an
    exception's message may quote the caller) can start a line of its own."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, self.datefmt)
        line = one_line(self.formatMessage(record))
        # From exc_info where there is one: a record's cached exc_text may be another formatter's, raw.
        exc = self.formatException(record.exc_info) if record.exc_info else record.exc_text
        for block in (exc, record.stack_info and self.formatStack(record.stack_info)):
            if block:
                line += "\n" + _indented(block)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the record's extra fields, and
    the trace/span ids of the record's span (given as extra) or else of the current span.
    The message and string fields are escaped as in text lines, so a reader that prints them
    still gets one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": one_line(record.getMessage()),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = one_line(value) if isinstance(value, str) else value
        if "trace_id" not in out:
            ctx = trace.get_current_span().get_span_context()
            if ctx.is_valid:
                out["trace_id"] = format(ctx.trace_id, "032x")
                out["span_id"] = format(ctx.span_id, "016x")
        exc = self.formatException(record.exc_info) if record.exc_info else record.exc_text
        if exc:
            out["exception"] = exc
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False).translate(_JSON_ESCAPES)


def setup_logging(config: LogConfig, stream: TextIO | None = None) -> logging.Handler:
    """Configure the root logger for the server (replacing its handlers); returns the handler.
    Python warnings become records too (a raw multi-line warning is not a log line)."""
    global _active
    _active = config
    allow_text(config.text)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if config.format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.level.upper())
    logging.captureWarnings(True)
    return handler


RELAY_SCRIPT = Path(__file__).with_name("stderr_relay.py")
RELAY_EXIT_WAIT_S = 1.0


def relay_stderr() -> subprocess.Popen[bytes]:
    """Point fd 2 at a pipe read by a small child process that passes JSON lines on to the real
    stderr and wraps every other line in a JSON record: gRPC's C core, torch's C++ and a crash's
    last words write to fd 2 directly, past logging. The processes this one starts inherit the
    pipe. A child process, not a thread, so that the lines of a fatal error still come out: it
    reads until every writer has gone. At a normal exit this process tells it so and waits for
    it (in a container the server is PID 1, whose end stops every other process there)."""
    sys.stderr.flush()
    end = secrets.token_hex(16)
    read, write = os.pipe()
    relay = subprocess.Popen([sys.executable, "-I", str(RELAY_SCRIPT), end], stdin=read, stdout=2, stderr=2)
    original = os.dup(2)
    os.dup2(write, 2)
    os.close(write)
    os.close(read)

    def finish() -> None:
        try:
            sys.stderr.flush()
            os.write(2, f"\n{end}\n".encode())
        except OSError:
            pass
        os.dup2(original, 2)
        try:
            relay.wait(RELAY_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            pass

    atexit.register(finish)
    return relay


def active_config() -> LogConfig | None:
    """The logging this process was set up with (None: not by `setup_logging`)."""
    return _active


__all__ = ["JsonFormatter", "TextFormatter", "active_config", "one_line", "relay_stderr", "setup_logging"]
