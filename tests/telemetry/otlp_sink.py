"""A minimal OTLP/gRPC receiver (the collector's trace and metrics services), keeping what it
is sent: the far end of OTLP export in tests and in the overhead benchmark."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as mpb
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as mgrpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc


class OtlpSink(tgrpc.TraceServiceServicer, mgrpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.span_names: list[str] = []
        self.metric_names: set[str] = set()
        self.received = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        tgrpc.add_TraceServiceServicer_to_server(self, self.server)
        mgrpc.add_MetricsServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request: object, context: grpc.ServicerContext) -> object:
        with self.received:
            if isinstance(request, tpb.ExportTraceServiceRequest):
                self.span_names += [s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
                self.received.notify_all()
                return tpb.ExportTraceServiceResponse()
            assert isinstance(request, mpb.ExportMetricsServiceRequest)
            self.metric_names |= {m.name for rm in request.resource_metrics for sm in rm.scope_metrics
                                  for m in sm.metrics}
            self.received.notify_all()
            return mpb.ExportMetricsServiceResponse()

    def close(self) -> None:
        self.server.stop(grace=None)
