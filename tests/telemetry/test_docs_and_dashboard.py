"""Every metric the server exports is documented in docs/observability.md (the README links there),
and the Grafana dashboard queries only series that a real scrape of our metrics endpoint contains."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from service.telemetry import Telemetry
from service.telemetry.exporters import MetricsEndpoint
from service.telemetry.rpc import RpcInterceptor

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "helm" / "cadenza" / "dashboards" / "cadenza.json"


def _record_everything(telemetry: Telemetry) -> None:
    """One value into every instrument the server has (and the pulled ones registered)."""
    telemetry.observe(cache=lambda: (1, 2), gpu_memory=lambda: {"cuda:0": 1 << 20})
    RpcInterceptor(telemetry).duration.record(0.01, {"rpc.method": "a/b", "rpc.response.status_code": "OK"})
    labels = {"cadenza.voice": "v", "cadenza.precision": "fp16"}
    for instrument in vars(telemetry).values():
        if hasattr(instrument, "record"):
            instrument.record(1.0, labels)
        elif hasattr(instrument, "add") and hasattr(instrument, "name"):
            instrument.add(1, labels)


@pytest.fixture(scope="module")
def scrape() -> Iterator[str]:
    """The Prometheus text our endpoint serves with every instrument recorded once."""
    endpoint = MetricsEndpoint("127.0.0.1", 0)
    try:
        _record_everything(Telemetry(MeterProvider(metric_readers=[endpoint.reader])))
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=5) as r:
            yield r.read().decode()
    finally:
        endpoint.close()


def test_every_metric_is_documented() -> None:
    reader = InMemoryMetricReader()
    _record_everything(Telemetry(MeterProvider(metric_readers=[reader])))
    data = reader.get_metrics_data()
    assert data is not None
    names = {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert len(names) >= 20
    doc = (ROOT / "docs" / "observability.md").read_text()
    section = doc[doc.index("## Metrics"):]
    section = section[: section.index("\n## ", 1)]
    documented = set(re.findall(r"^\| `([a-z][a-z0-9_.]+)` \|", section, re.MULTILINE))
    assert names == documented


def test_dashboard_queries_exported_series(scrape: str) -> None:
    families = set(re.findall(r"^# TYPE (\S+) ", scrape, re.MULTILINE))
    series = families | {f + s for f in families for s in ("_bucket", "_count", "_sum", "_total")}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    labels = set(re.findall(r"[{,]([A-Za-z_][A-Za-z0-9_]*)=", scrape)) | {"le"}
    used = {name for e in exprs for name in re.findall(r"\b((?:cadenza|hw|rpc)_[A-Za-z0-9_]+)", e)} - labels
    assert used and used <= series, used - series
    text = "\n".join(exprs)
    for needle in ("histogram_quantile(0.5, sum by (le) (rate(cadenza_session_time_to_first_audio_seconds_bucket",
                   "histogram_quantile(0.99, sum by (le) (rate(cadenza_session_time_to_first_audio_seconds_bucket",
                   "cadenza_sessions_active", "cadenza_engine_compute_duration_seconds_total",
                   "cadenza_guard_fp32_fallbacks_total", "cadenza_shadow_psnr_dB_bucket"):
        assert needle in text, needle
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {"${datasource}"}
