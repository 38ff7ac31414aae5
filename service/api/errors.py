"""The one error boundary every servicer's RPCs go through, and their registration.

`add_service` registers a servicer's handlers as the generated ``add_*_to_server`` functions
do, with two differences that make every API answer any input with a clean status:

* Requests are decoded by `decoder`: bytes that are not a valid message (truncated, corrupt,
  invalid UTF-8 in a string field, another message type) become an `UndecodableRequest`
  instead of an exception inside grpc (which answers UNKNOWN with a Python class name and
  logs a traceback). For request streams the sentinel arrives in the request iterator.
* Each handler is wrapped by `boundary`: an undecodable request ends the RPC with
  INVALID_ARGUMENT; an `EngineError` with its status and message (field names translated
  to the API's own); anything else with INTERNAL and a short error id, logged once with its
  traceback under that id (at most once per minute for the same kind of error and place,
  counting the rest). Messages are capped, so client input cannot come back unbounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import secrets
import threading
import time
import traceback
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from grpc._cython import cygrpc  # ExecuteBatchError: a write to a call that is over

from service.engine.contract import (
    ClientStalled,
    EngineError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    Unavailable,
)
from service.telemetry.logs import redact

__all__ = [
    "INTERNAL_ERRORS",
    "MAX_STATUS_MESSAGE_CHARS",
    "IdleTimeout",
    "InternalErrorLog",
    "MalformedRequest",
    "Method",
    "UndecodableRequest",
    "abort_with",
    "add_service",
    "boundary",
    "decoder",
    "methods_of",
    "renamed",
    "status_for",
    "status_name",
]

log = logging.getLogger(__name__)

MAX_STATUS_MESSAGE_CHARS = 1000  # a status message never grows past this (client input is clipped before)


class IdleTimeout(EngineError):
    """The client sent nothing for longer than the idle limit."""


class MalformedRequest(EngineError):
    """The request bytes are not a valid message of the RPC's request type."""


_STATUS: tuple[tuple[type[EngineError], grpc.StatusCode], ...] = (
    (IdleTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (ClientStalled, grpc.StatusCode.DEADLINE_EXCEEDED),
    (MalformedRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (OutOfRange, grpc.StatusCode.OUT_OF_RANGE),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),  # before its base class
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
)


def status_for(error: EngineError) -> grpc.StatusCode:
    for kind, code in _STATUS:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def status_name(error: BaseException) -> str:
    """The gRPC status an exception ends an RPC with (the session-end log line and spans)."""
    return status_for(error).name if isinstance(error, EngineError) else grpc.StatusCode.INTERNAL.name


# Client-caused statuses are logged at INFO; the rest (the server's own trouble or limits) at WARNING.
_CLIENT_STATUSES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
                    grpc.StatusCode.FAILED_PRECONDITION}


def _log_error(rpc: str, code: grpc.StatusCode, error: EngineError) -> None:
    """One line per failed RPC with its status. A message about the text field may quote the
    caller's text: it is withheld unless the server runs with --log-text."""
    quotes_text = isinstance(error, InvalidArgument) and ("text" in error.field or "input" in error.field)
    message = redact(error.message) if quotes_text else error.message
    level = logging.INFO if code in _CLIENT_STATUSES else logging.WARNING
    log.log(level, "%s failed: %s: %s", rpc, code.name, _capped(message), extra={"rpc": rpc, "status": code.name})


def _capped(message: str) -> str:
    if len(message) <= MAX_STATUS_MESSAGE_CHARS:
        return message
    return message[: MAX_STATUS_MESSAGE_CHARS - 1] + "…"


async def abort_with(context: grpc.aio.ServicerContext, error: EngineError) -> NoReturn:
    """End the RPC with the error's status and its message (which says what to change)."""
    await context.abort(status_for(error), _capped(error.message))
    raise AssertionError("context.abort returned")  # pragma: no cover


# --- decoding --------------------------------------------------------------------------------


@dataclass(frozen=True)
class UndecodableRequest:
    """What `decoder` returns for bytes that are not a valid request message."""

    message_name: str
    reason: str

    def error(self) -> MalformedRequest:
        return MalformedRequest(f"the request is not a valid {self.message_name} message ({self.reason})")


def _reason(exc: Exception) -> str:
    """A short, implementation-neutral reason for a protobuf parse failure."""
    text = str(exc).lower()
    if "utf-8" in text or "utf8" in text:
        return "a string field is not valid UTF-8"
    if "recursion" in text or "depth" in text:
        return "messages nested too deeply"
    return "truncated or corrupt bytes, or another message type"


def decoder(message_class: Any) -> Callable[[bytes], Any]:
    """A request deserializer that never raises: a bad message becomes an `UndecodableRequest`."""
    parse = message_class.FromString
    name = message_class.DESCRIPTOR.name

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # DecodeError, or anything else the parser trips on
            return UndecodableRequest(name, _reason(exc))

    return deserialize


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """The request stream, ending the RPC with INVALID_ARGUMENT at the first undecodable message."""
    async for request in requests:
        if isinstance(request, UndecodableRequest):
            raise request.error()
        yield request


# --- internal errors -------------------------------------------------------------------------


class InternalErrorLog:
    """Logs unexpected exceptions under short ids: one traceback per (type, place) per window."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    @staticmethod
    def key(exc: BaseException) -> tuple[str, str]:
        frames = traceback.extract_tb(exc.__traceback__)
        place = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        kind = type(exc)
        return f"{kind.__module__}.{kind.__qualname__}", place

    def record(self, rpc: str, exc: BaseException) -> str:
        """Log `exc` (or count it, if its kind was logged within the window); return its id."""
        error_id = secrets.token_hex(4)
        key = self.key(exc)
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.window_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return error_id
            self._last[key] = now
            skipped = self._suppressed.pop(key, 0)
            if len(self._last) > 10_000:  # bounded memory, whatever the variety of errors
                self._last = {k: t for k, t in self._last.items() if now - t < self.window_s}
        more = f" ({skipped} more like it in the last {self.window_s:g} s, not logged)" if skipped else ""
        log.error("%s failed: INTERNAL: internal error %s%s", rpc, error_id, more,
                  exc_info=(type(exc), exc, exc.__traceback__), extra={"rpc": rpc, "status": "INTERNAL"})
        return error_id


INTERNAL_ERRORS = InternalErrorLog()


# --- the boundary ----------------------------------------------------------------------------


def renamed(error: EngineError, fields: Mapping[str, str]) -> EngineError:
    """The error with a native field name (``config.sample_rate``) replaced by the API's own."""
    if not isinstance(error, InvalidArgument) or error.field not in fields:
        return error
    return InvalidArgument(fields[error.field], error.message.removeprefix(f"{error.field}: "))


async def _fail(context: grpc.aio.ServicerContext, rpc: str, exc: Exception, fields: Mapping[str, str]) -> NoReturn:
    if isinstance(exc, EngineError):
        error = renamed(exc, fields)
        _log_error(rpc, status_for(error), error)
        await abort_with(context, error)
    error_id = INTERNAL_ERRORS.record(rpc, exc)
    await context.abort(grpc.StatusCode.INTERNAL,
                        f"internal error {error_id}: the server logged the details under this id; please report it")
    raise AssertionError("context.abort returned")  # pragma: no cover


async def _write(context: grpc.aio.ServicerContext, response: Any, stall_s: float) -> None:
    """Send one response; a client whose transport takes nothing for `stall_s` (it stopped reading
    and its flow-control window is full) gets DEADLINE_EXCEEDED now, after the messages it already
    holds, instead of holding the stream, its session and its audio open until it reads again."""
    task = asyncio.current_task()
    assert task is not None
    fired = False

    def stalled() -> None:
        nonlocal fired
        fired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(stall_s, stalled)
    try:
        await context.write(response)
    except asyncio.CancelledError:
        if not fired:
            raise
        task.uncancel()
        raise ClientStalled(f"the client took no audio for {stall_s:g} s; the stream is closed (read the "
                            "audio as it arrives)") from None
    except cygrpc.ExecuteBatchError:  # the transport refused the message: the call is over
        raise _ClientGone from None  # the client cancelled or left: nothing to send, nothing wrong
    finally:
        timer.cancel()


class _ClientGone(Exception):
    """A response could not be written because the call is over (the client cancelled)."""


# A bidirectional stream that ends with an error while its client is still writing: the client's
# pending writes fail, and some clients (grpc.aio) then report that failure instead of the status.
# So the requests the client already sent are read (and dropped) first: until it half-closes or
# sends nothing for DRAIN_GAP_S, for at most DRAIN_REQUESTS_S.
DRAIN_REQUESTS_S = 1.0
DRAIN_GAP_S = 0.05


async def _drain(requests: AsyncIterator[Any]) -> None:
    """Read what the client already sent, within the limits above."""
    deadline = time.monotonic() + DRAIN_REQUESTS_S
    with contextlib.suppress(Exception, asyncio.TimeoutError):
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.wait_for(anext(requests), min(DRAIN_GAP_S, left))


def boundary(
    handler: Callable[..., Any], rpc: str, request_streaming: bool, fields: Mapping[str, str] | None = None,
    write_stall_s: float = math.inf,
) -> Callable[..., Any]:
    """`handler` (a servicer method) with every failure turned into a clean status (see the module doc).

    Works for coroutine handlers (unary responses) and async-generator handlers (streamed responses,
    written here with `write_stall_s` as the longest a client may leave a response untaken)."""
    names: Mapping[str, str] = fields or {}

    def request_of(request: Any) -> Any:
        if request_streaming:
            return _checked(request)
        if isinstance(request, UndecodableRequest):
            raise request.error()
        return request

    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> None:
            responses: AsyncGenerator[Any] | None = None
            try:
                responses = handler(request_of(request), context)
                async for response in responses:
                    try:
                        await _write(context, response, write_stall_s)
                    except ClientStalled as exc:  # thrown into the handler: its session ends with it
                        await responses.athrow(exc)
                    except _ClientGone:  # the handler ends as when the client leaves while it waits
                        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                            await responses.athrow(asyncio.CancelledError())
                        return
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                if request_streaming:
                    await _drain(request)
                await _fail(context, rpc, exc, names)
            finally:
                if responses is not None:
                    await responses.aclose()

        return stream

    @functools.wraps(handler)
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(request_of(request), context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _fail(context, rpc, exc, names)

    return unary


# --- registration ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """One RPC of a service: its message classes and which sides stream."""

    request: Any
    response: Any
    request_streaming: bool
    response_streaming: bool


def methods_of(service: ServiceDescriptor) -> dict[str, Method]:
    """The RPCs of a generated service, read from its descriptor."""
    return {
        m.name: Method(message_factory.GetMessageClass(m.input_type), message_factory.GetMessageClass(m.output_type),
                       m.client_streaming, m.server_streaming)
        for m in service.methods
    }


_HANDLERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_service(
    server: grpc.aio.Server,
    service_name: str,
    servicer: object,
    methods: Mapping[str, Method],
    fields: Mapping[str, Mapping[str, str]] | None = None,
    *,
    write_stall_s: float,
) -> None:
    """Register `servicer`'s methods under `service_name`, each behind `boundary` and `decoder`.

    `fields`: per RPC, native field names -> the API's names, for INVALID_ARGUMENT messages."""
    handlers = {}
    for name, method in methods.items():
        wrapped = boundary(getattr(servicer, name), f"{service_name}/{name}", method.request_streaming,
                           (fields or {}).get(name), write_stall_s)
        make = _HANDLERS[(method.request_streaming, method.response_streaming)]
        handlers[name] = make(wrapped, request_deserializer=decoder(method.request),
                              response_serializer=method.response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
    server.add_registered_method_handlers(service_name, handlers)
