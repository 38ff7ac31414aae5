"""gRPC server spans and metrics for the grpc.aio server.

OpenTelemetry's gRPC instrumentation traces aio servers but records no RPC metrics, so one
interceptor of ours does both: a SERVER span per RPC (continuing the caller's W3C
`traceparent` from the metadata) and `rpc.server.call.duration` with the final status.
Health checks and reflection are left out (probes would drown the rest)."""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from service.telemetry.telemetry import SECONDS_BUCKETS, Telemetry

UNTRACED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


class RpcInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.duration = telemetry.meter.create_histogram(
            "rpc.server.call.duration", unit="s", description="gRPC server call duration, by method and status",
            explicit_bucket_boundaries_advisory=list(SECONDS_BUCKETS))

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(UNTRACED_PREFIXES):
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        if handler.response_streaming:
            behavior = handler.unary_stream or handler.stream_stream
            # A handler that writes its responses itself (context.write) is a coroutine.
            wrap = self._streaming if inspect.isasyncgenfunction(behavior) else self._unary
            wrapped: Any = wrap(behavior, method, metadata)
        else:
            behavior = handler.unary_unary or handler.stream_unary
            wrapped = self._unary(behavior, method, metadata)
        kind = {(False, False): "unary_unary", (False, True): "unary_stream", (True, False): "stream_unary",
                (True, True): "stream_stream"}[(handler.request_streaming, handler.response_streaming)]
        return handler._replace(**{kind: wrapped})

    def _start(self, method: str, metadata: Any) -> trace.Span:
        """The RPC's span, made current for the handler's task (each RPC runs in its own task,
        so the attached context ends with it)."""
        parent = propagate.extract({m.key: m.value for m in metadata if isinstance(m.value, str)})
        service, _, name = method.lstrip("/").partition("/")
        span = self.telemetry.tracer.start_span(
            method.lstrip("/"), context=parent, kind=SpanKind.SERVER,
            attributes={"rpc.system.name": "grpc", "rpc.method": f"{service}/{name}"})
        otel_context.attach(trace.set_span_in_context(span, parent))
        return span

    def _finish(self, span: trace.Span, method: str, context: grpc.aio.ServicerContext, started: float,
                error: BaseException | None) -> None:
        code = context.code() if hasattr(context, "code") else None
        if isinstance(code, int):  # some grpc versions give the numeric value
            code = next((c for c in grpc.StatusCode if c.value[0] == code), None)
        if code is None:
            code = grpc.StatusCode.OK if error is None else (
                grpc.StatusCode.CANCELLED if isinstance(error, BaseException) and not isinstance(error, Exception)
                else grpc.StatusCode.UNKNOWN)
        status = code.name
        self.duration.record(time.monotonic() - started, {"rpc.system.name": "grpc",
                                                          "rpc.method": method.lstrip("/"),
                                                          "rpc.response.status_code": status})
        span.set_attribute("rpc.response.status_code", status)
        if code is not grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, status))
        span.end()

    @contextlib.contextmanager
    def _observed(self, method: str, metadata: Any, context: grpc.aio.ServicerContext) -> Iterator[None]:
        """Around one call: its span (current inside) and, at the end, its duration and status."""
        started = time.monotonic()
        span = self._start(method, metadata)
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._finish(span, method, context, started, error)

    def _unary(self, behavior: Callable[..., Any], method: str, metadata: Any) -> Callable[..., Any]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with self._observed(method, metadata, context):
                return await behavior(request, context)

        return call

    def _streaming(self, behavior: Callable[..., Any], method: str, metadata: Any) -> Callable[..., Any]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with self._observed(method, metadata, context):
                async for response in behavior(request, context):
                    yield response

        return call


__all__ = ["RpcInterceptor"]
