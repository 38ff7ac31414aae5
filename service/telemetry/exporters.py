"""Building the providers a `Telemetry` records into, from a `TelemetryConfig`: a Prometheus
scrape endpoint and OTLP export (both optional; with neither, nothing is recorded)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from service.telemetry.config import TelemetryConfig
from service.telemetry.telemetry import Telemetry, _version

log = logging.getLogger(__name__)


class MetricsEndpoint:
    """`GET /metrics` in the Prometheus text format, on its own port and thread. With several
    API server processes, the first one's endpoint also reads the others' (`also`: their
    loopback endpoints' URLs) and adds their figures up, so a pod stays one scrape target
    whose series read as those of one process."""

    def __init__(self, host: str, port: int) -> None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry()  # per server, not the process-global one
        self.reader = PrometheusMetricReader(registry=self.registry)
        self.also: list[str] = []
        bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            self._server, self._thread = start_http_server(port, addr=bare,
                                                           registry=_Summed(self.registry, self.also))
        except OSError as exc:
            self.reader.shutdown()
            raise OSError(f"cannot serve metrics on {host}:{port} (--metrics-port): {exc.strerror or exc}") from None
        self.port = int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Summed:
    """A registry's families plus those of the other processes' endpoints, sample by sample
    summed (counters, histograms and the open-session gauge all add up). Their `target_info`
    (the OpenTelemetry resource, one per process) is left out: the pod is one target. An
    endpoint that cannot be read is left out of that scrape and logged."""

    TIMEOUT_S = 2.0

    def __init__(self, own: Any, also: list[str]) -> None:
        self.own = own
        self.also = also

    def restricted_registry(self, names: Any) -> Any:
        return self.own.restricted_registry(names)

    def collect(self) -> Iterator[Any]:
        families = {family.name: family for family in self.own.collect()}
        for family in self._others():
            have = families.get(family.name)
            if have is None:
                families[family.name] = family
                continue
            index = {(s.name, tuple(sorted(s.labels.items()))): i for i, s in enumerate(have.samples)}
            for sample in family.samples:
                at = index.get((sample.name, tuple(sorted(sample.labels.items()))))
                if at is None:
                    have.samples.append(sample)
                else:
                    have.samples[at] = have.samples[at]._replace(value=have.samples[at].value + sample.value)
        yield from families.values()

    def _others(self) -> Iterator[Any]:
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        for url in list(self.also):
            try:
                with urllib.request.urlopen(url, timeout=self.TIMEOUT_S) as response:
                    text = response.read().decode("utf-8")
            except OSError as exc:
                log.warning("metrics: cannot read %s (%s); its figures are missing from this scrape", url, exc)
                continue
            yield from (f for f in text_string_to_metric_families(text) if f.name != "target_info")


def build_telemetry(config: TelemetryConfig, default_host: str,
                    status_of: Callable[[BaseException], str] | None = None) -> Telemetry:
    """A `Telemetry` exporting where `config` says (`default_host`: the metrics endpoint's
    address when the config names none). With no exporter it records nothing."""
    readers: list[MetricReader] = []
    closers: list[Callable[[], None]] = []
    endpoint = None
    if config.metrics_port is not None:
        endpoint = MetricsEndpoint(config.metrics_host or default_host, config.metrics_port)
        readers.append(endpoint.reader)
        closers.append(endpoint.close)
        log.info("metrics on http://%s:%d/metrics", config.metrics_host or default_host, endpoint.port)
    if config.otlp_metrics:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(),
                                                     export_interval_millis=config.otlp_interval_s * 1000))
    resource = Resource.create({"service.name": "cadenza", "service.version": _version()})
    meters = MeterProvider(metric_readers=readers, resource=resource) if readers else None
    tracer = None
    if config.traces:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        tracer = TracerProvider(resource=resource)
        tracer.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if config.otlp_metrics or config.otlp_traces:
        log.info("OTLP export: %s", ", ".join(k for k, on in (("metrics", config.otlp_metrics),
                                                                ("traces", config.otlp_traces)) if on))
    telemetry = Telemetry(meters, tracer, status_of=status_of, log_text=config.log.text,
                          step_span_links=config.step_span_links)
    telemetry.closers.extend(closers)
    telemetry.metrics_port = endpoint.port if endpoint is not None else None
    telemetry.metrics_also = endpoint.also if endpoint is not None else None
    return telemetry


__all__ = ["MetricsEndpoint", "build_telemetry"]
