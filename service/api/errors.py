"""One place that turns typed engine errors into gRPC statuses."""

from __future__ import annotations

from typing import NoReturn

import grpc

from service.engine.api import (
    EngineError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

_STATUS: tuple[tuple[type[EngineError], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),  # before its base class
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
)


class IdleTimeout(EngineError):
    """The client sent nothing for longer than the idle limit."""


def status_for(error: EngineError) -> grpc.StatusCode:
    if isinstance(error, IdleTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    for kind, code in _STATUS:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, error: EngineError) -> NoReturn:
    """End the RPC with the error's status and its message (which says what to change)."""
    await context.abort(status_for(error), error.message)
    raise AssertionError("context.abort returned")  # pragma: no cover
