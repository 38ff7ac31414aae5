"""Is a listening port free? Kept free of heavy imports, so `cadenza serve` can refuse a taken
port at once, before torch, grpc or any voice is loaded."""

from __future__ import annotations

import errno
import socket

DEFAULT_HOST = "127.0.0.1"  # loopback only; --host 0.0.0.0 or [::] listens on every interface
DEFAULT_PORT = 50051


def host_port(host: str, port: int) -> str:
    """`host:port` as gRPC parses it: an IPv6 literal goes in brackets ([::1]:50051), else its
    colons would be read as the port's."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


class PortInUseError(OSError):
    """The listening address is taken (by another server, or anything else)."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(errno.EADDRINUSE, f"port {port} is already in use on {host}; stop the other server, "
                                           "or pick another port with --port (--port 0 picks a free one)")
        self.host = host
        self.port = port

    def __str__(self) -> str:
        return str(self.strerror)


def check_port_free(host: str, port: int) -> None:
    """Raise PortInUseError if `host:port` cannot be bound now (the check grpc's own bind makes,
    but before anything slow is imported or loaded). Port 0 always passes; other bind errors are
    left to the server's own bind, which reports them."""
    if port == 0:
        return
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        addresses = socket.getaddrinfo(bare or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    for family, kind, proto, _, address in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc does: TIME_WAIT is no conflict
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # [::] also takes 0.0.0.0
                probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(host, port) from None
