"""`cadenza health`: one grpc.health.v1 Check against a server, for container health checks and
Kubernetes exec probes (kubelet's own gRPC probe speaks plaintext only, so a TLS server needs this).

Imports grpc and the health stubs only (no torch): a health check runs every few seconds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HealthCheck", "UnknownServiceError", "check_health"]


class UnknownServiceError(ValueError):
    """The server reports on no service of that name."""


@dataclass(frozen=True)
class HealthCheck:
    addr: str = "localhost:50051"
    service: str = ""  # "" = the whole server; or an API's service name
    timeout_s: float = 5.0
    tls_ca: Path | None = None  # PEM CA bundle: connect over TLS
    tls_server_name: str | None = None  # the name the server's certificate is checked against
    tls_cert: Path | None = None  # client certificate (mutual TLS)
    tls_key: Path | None = None


def check_health(check: HealthCheck) -> str:
    """The server's status name (SERVING, NOT_SERVING, ...); grpc.RpcError when unreachable,
    UnknownServiceError (naming the ones it has) for a service it does not report on."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if check.tls_ca is not None or check.tls_cert is not None:
        creds = grpc.ssl_channel_credentials(
            root_certificates=check.tls_ca.read_bytes() if check.tls_ca else None,
            private_key=check.tls_key.read_bytes() if check.tls_key else None,
            certificate_chain=check.tls_cert.read_bytes() if check.tls_cert else None,
        )
        options = [("grpc.ssl_target_name_override", check.tls_server_name)] if check.tls_server_name else []
        channel = grpc.secure_channel(check.addr, creds, options=options)
    else:
        channel = grpc.insecure_channel(check.addr)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=check.service), timeout=check.timeout_s)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND or not check.service:
                raise
            known = _services(channel, check.timeout_s)
            listed = f"it has {', '.join(known)}" if known else "it did not list the ones it has"
            raise UnknownServiceError(f"{check.addr} has no service {check.service!r}; {listed} (or leave "
                                      "--service out for the whole server)") from None
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def _services(channel: Any, timeout_s: float) -> list[str]:
    """The services the server lists through reflection, less health and reflection themselves
    (the server reports no health status for those); none where it does not answer."""
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    request = reflection_pb2.ServerReflectionRequest(list_services="")
    try:
        answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([request]),
                                                                                         timeout=timeout_s)
        names = [s.name for answer in answers for s in answer.list_services_response.service]
    except grpc.RpcError:
        return []
    return sorted(n for n in names if not n.startswith(("grpc.health.", "grpc.reflection.")))
