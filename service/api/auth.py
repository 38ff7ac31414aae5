"""API keys: a grpc.aio server interceptor that requires `authorization: Bearer <key>` metadata.

Every RPC needs a known key except health checks and server reflection (probes and tools must
work without one). Keys are compared in constant time (hmac.compare_digest, against every key)
and never logged."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

__all__ = ["OPEN_SERVICES", "UNAUTHENTICATED_MESSAGE", "ApiKeyInterceptor", "bearer_metadata", "load_api_keys"]

failures = logging.getLogger("service.api.errors")  # where every failed RPC is logged

# Services callable without a key: the gRPC health check and server reflection (v1 and v1alpha).
OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                 "grpc.reflection.v1alpha.ServerReflection")
UNAUTHENTICATED_MESSAGE = "missing or unknown API key (send 'authorization: Bearer <key>')"


def load_api_keys(path: str | Path) -> tuple[str, ...]:
    """The keys in `path`: one per line; blank lines and lines starting with `#` are ignored.
    A file without any key is an error (it would refuse every call)."""
    keys = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        key = line.strip()
        if key and not key.startswith("#"):
            keys.append(key)
    if not keys:
        raise ValueError(f"{path}: no API keys in the file (one per line; '#' starts a comment)")
    return tuple(keys)


def bearer_metadata(key: str) -> tuple[str, str]:
    """The metadata entry that carries `key`."""
    return "authorization", f"Bearer {key}"


def _bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> bytes | None:
    for name, value in metadata or ():
        if name.lower() != "authorization":
            continue
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip().encode("utf-8")
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a known API key with UNAUTHENTICATED (the handler never runs)."""

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self._keys = tuple(key.encode("utf-8") for key in keys)

    def __repr__(self) -> str:  # never the keys
        return f"ApiKeyInterceptor({len(self._keys)} key(s))"

    def refusal(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """Why a call with `metadata` is refused (None: it is not). The reason never quotes the key."""
        token = _bearer_token(metadata)
        if token is None:
            return "no API key ('authorization: Bearer <key>' metadata)"
        found = False
        for key in self._keys:  # every key, so the time taken does not say which one matched
            found |= hmac.compare_digest(token, key)
        return None if found else "unknown API key"

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        return self.refusal(metadata) is None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        service = method.lstrip("/").partition("/")[0]
        reason = None if service in OPEN_SERVICES else self.refusal(handler_call_details.invocation_metadata)
        if reason is None:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: UNIMPLEMENTED, as without keys
            return handler
        # The one line per failed RPC (see service.api.errors): a client's mistake, so INFO.
        rpc = method.lstrip("/")
        failures.info("%s failed: UNAUTHENTICATED: %s", rpc, reason, extra={"rpc": rpc, "status": "UNAUTHENTICATED"})
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts with UNAUTHENTICATED. The request
    is left undecoded (no deserializer), so a malformed message gets the same answer."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        yield  # pragma: no cover  (abort raises: this only makes the function a generator)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)
