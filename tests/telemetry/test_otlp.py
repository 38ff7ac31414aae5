"""OTLP export, switched on by the standard environment variables read at start-up, reaches a
real OTLP/gRPC receiver (the exporter's protobuf 7 messages on the wire)."""

from __future__ import annotations

import os

import pytest

from service.api.client import connect, stream
from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.telemetry import TelemetryConfig
from service.telemetry.exporters import build_telemetry
from tests.telemetry.conftest import TIMEOUT_S, ObservedServer, tiny_server_config
from tests.telemetry.otlp_sink import OtlpSink


def test_otlp_only_when_the_environment_asks() -> None:
    assert not TelemetryConfig().with_env({}).otlp_traces
    traces = TelemetryConfig().with_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4317"})
    assert traces.otlp_traces and not traces.otlp_metrics
    both = TelemetryConfig().with_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"})
    assert both.otlp_traces and both.otlp_metrics
    assert build_telemetry(TelemetryConfig(), "127.0.0.1").meter_provider is None  # nothing to export to


def test_session_spans_and_metrics_reach_an_otlp_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    sink = OtlpSink()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.endpoint)
    telemetry = build_telemetry(TelemetryConfig().with_env(os.environ), "127.0.0.1")
    server = ObservedServer(tiny_server_config(), telemetry)
    try:
        channel, stub = connect(server.addr)
        try:
            result = stream(stub, pb.SessionConfig(seed=1), ["Exported over OTLP."], timeout=TIMEOUT_S)
        finally:
            channel.close()
        assert result.summary is not None
    finally:
        server.close()
        telemetry.shutdown()  # flushes the span batch and the last metrics
        sink.close()
    assert {"cadenza.session", "cadenza.utterance", "cadenza.v1.TextToSpeech/StreamingSynthesize"} \
        <= set(sink.span_names)
    assert {"cadenza.session.time_to_first_audio", "cadenza.sessions.active", "rpc.server.call.duration"} \
        <= sink.metric_names
