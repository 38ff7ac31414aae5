"""Observability: our instrumentation interface (`Telemetry`), its exporters and logging.

Only this package imports OpenTelemetry; the engine and the servicers call `Telemetry`."""

from service.telemetry.config import LogConfig, TelemetryConfig
from service.telemetry.telemetry import SessionInfo, SessionTrace, Telemetry

__all__ = ["LogConfig", "SessionInfo", "SessionTrace", "Telemetry", "TelemetryConfig"]
