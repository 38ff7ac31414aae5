"""A real server (tiny voice, torch on CPU) recording into in-memory OpenTelemetry readers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.api.server import CadenzaServer, ServerConfig
from service.engine.config import BatchConfig, EngineConfig, Limits
from service.telemetry import Telemetry
from tests.api.native_server import ServerThread

DATA = Path(__file__).resolve().parents[1] / "data"
TIMEOUT_S = 60


def tiny_server_config(limits: Limits | None = None, **engine: Any) -> ServerConfig:
    engine.setdefault("core", "thread")  # some tests inject faults into the core's backends
    return ServerConfig(
        host="127.0.0.1", port=0, drain_grace_s=2.0,
        engine=EngineConfig(limits=limits or Limits(max_text_chars=2000),
                            voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu", threads=1,
                            batch=BatchConfig(), cache_bytes=0, **engine),
    )


@dataclass
class Observed:
    """In-memory readers of one server's telemetry."""

    metrics: InMemoryMetricReader
    spans: InMemorySpanExporter
    telemetry: Telemetry

    def points(self, name: str) -> list[Any]:
        """Every data point of metric `name` collected now (cumulative)."""
        data = self.metrics.get_metrics_data()
        out = []
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == name:
                        out.extend(m.data.data_points)
        return out

    def total(self, name: str, **attributes: Any) -> float:
        """Sum of a counter's values (or a histogram's counts) over points matching `attributes`."""
        total = 0.0
        for p in self.points(name):
            if all(p.attributes.get(k) == v for k, v in attributes.items()):
                total += p.count if hasattr(p, "count") else p.value
        return total

    def finished(self, name: str | None = None) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if name is None or s.name == name]


def observed() -> Observed:
    reader, exporter = InMemoryMetricReader(), InMemorySpanExporter()
    tracer = TracerProvider()
    tracer.add_span_processor(SimpleSpanProcessor(exporter))
    return Observed(reader, exporter, Telemetry(MeterProvider(metric_readers=[reader]), tracer))


class ObservedServer(ServerThread):
    """ServerThread recording into the given telemetry (an `Observed`'s, or any `Telemetry`)."""

    def __init__(self, config: ServerConfig, seen: Observed | Telemetry) -> None:
        self.telemetry = seen.telemetry if isinstance(seen, Observed) else seen
        super().__init__(config)

    def _build(self, config: ServerConfig) -> CadenzaServer:
        return CadenzaServer(config, telemetry=self.telemetry)


@pytest.fixture(scope="module")
def seen() -> Observed:
    return observed()


@pytest.fixture(scope="module")
def server(seen: Observed) -> Iterator[ObservedServer]:
    s = ObservedServer(tiny_server_config(Limits(max_sessions=3, max_text_chars=2000, admission_wait_s=0.0)), seen)
    yield s
    s.close()


def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for `check` (a span or metric recorded just after the client saw the stream end)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


class HeldStream:
    """A session kept open: config, a sentence and a flush, then nothing until `release()`."""

    def __init__(self, stub: pb_grpc.TextToSpeechStub, text: str = "Hello there.") -> None:
        self._release = threading.Event()
        self.first_audio = threading.Event()
        self.error: grpc.RpcError | None = None
        self.audio = b""
        self.summary: pb.SessionSummary | None = None

        def requests() -> Iterator[pb.StreamingSynthesizeRequest]:
            yield pb.StreamingSynthesizeRequest(config=pb.SessionConfig(seed=1))
            yield pb.StreamingSynthesizeRequest(text=text)
            yield pb.StreamingSynthesizeRequest(flush=True)
            self._release.wait(TIMEOUT_S)
            yield pb.StreamingSynthesizeRequest(end_input=True)

        def run() -> None:
            try:
                for response in stub.StreamingSynthesize(requests(), timeout=TIMEOUT_S):
                    if response.HasField("audio"):
                        self.audio += response.audio.audio
                        self.first_audio.set()
                    elif response.HasField("summary"):
                        self.summary = response.summary
            except grpc.RpcError as exc:
                self.error = exc
                self.first_audio.set()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._release.set()
        self._thread.join(TIMEOUT_S)
