"""Server logging: level, text or JSON lines, trace and span ids in JSON records."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

from opentelemetry import trace

from service.telemetry.config import LogConfig

# LogRecord attributes that are not extra fields.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
WITHHELD = "[withheld: it quotes the caller's text; run the server with --log-text to log it]"

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


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the record's extra fields, and
    the trace/span ids of the record's span (given as extra) or else of the current span."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if "trace_id" not in out:
            ctx = trace.get_current_span().get_span_context()
            if ctx.is_valid:
                out["trace_id"] = format(ctx.trace_id, "032x")
                out["span_id"] = format(ctx.span_id, "016x")
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def setup_logging(config: LogConfig, stream: TextIO | None = None) -> logging.Handler:
    """Configure the root logger for the server (replacing its handlers); returns the handler."""
    global _active
    _active = config
    allow_text(config.text)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if config.format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.level.upper())
    return handler


def active_config() -> LogConfig | None:
    """The logging this process was set up with (None: not by `setup_logging`)."""
    return _active


__all__ = ["JsonFormatter", "active_config", "setup_logging"]
