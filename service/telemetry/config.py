"""Telemetry and logging settings, built once (CLI / tests) and passed explicitly."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# Any of these turns on OTLP export of traces and metrics (the exporters read the rest of the
# OTEL_EXPORTER_OTLP_* settings themselves: headers, certificates, protocol, timeouts).
_OTLP_ANY = "OTEL_EXPORTER_OTLP_ENDPOINT"
_OTLP_TRACES = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
_OTLP_METRICS = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"


@dataclass(frozen=True)
class LogConfig:
    """How the server logs (see the README's Observability section)."""

    level: str = "INFO"  # DEBUG | INFO | WARNING | ERROR | CRITICAL
    format: str = "text"  # text: one human line per record; json: one JSON object per line (trace ids)
    text: bool = False  # log the caller's text where a message would quote it (it can be personal data)

    def __post_init__(self) -> None:
        if self.level.upper() not in LOG_LEVELS:
            raise ValueError(f"unknown log level {self.level!r}; use {', '.join(LOG_LEVELS)}")
        if self.format not in LOG_FORMATS:
            raise ValueError(f"unknown log format {self.format!r}; use {' or '.join(LOG_FORMATS)}")


@dataclass(frozen=True)
class TelemetryConfig:
    """Where metrics and traces go. Everything off by default: no endpoint, no export."""

    metrics_port: int | None = None  # Prometheus scrape endpoint (GET /metrics); None: off
    metrics_host: str | None = None  # address it listens on; None: the gRPC server's --host
    otlp_traces: bool = False  # export spans over OTLP (set from OTEL_EXPORTER_OTLP_* at start-up)
    otlp_metrics: bool = False  # export metrics over OTLP (likewise)
    otlp_interval_s: float = 10.0  # how often metrics are pushed over OTLP
    step_span_links: int = 32  # an engine step's span links to at most this many sessions
    log: LogConfig = LogConfig()

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics port {self.metrics_port} is outside 0..65535 (--metrics-port)")

    @property
    def traces(self) -> bool:
        """Spans are recorded only when something exports them."""
        return self.otlp_traces

    def with_env(self, environ: Mapping[str, str]) -> TelemetryConfig:
        """This config with OTLP export switched on where the standard variables ask for it
        (called at start-up with the process environment; never at import)."""
        from dataclasses import replace

        def given(name: str) -> bool:
            return bool(environ.get(name, "").strip())

        return replace(
            self,
            otlp_traces=self.otlp_traces or given(_OTLP_ANY) or given(_OTLP_TRACES),
            otlp_metrics=self.otlp_metrics or given(_OTLP_ANY) or given(_OTLP_METRICS),
        )


__all__ = ["LOG_FORMATS", "LOG_LEVELS", "LogConfig", "TelemetryConfig"]
