"""The grpc.aio server: native servicer, health, reflection, limits, TLS, API keys and SIGTERM drain."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import riva.client.proto.riva_tts_pb2 as rtts
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from service.api.auth import ApiKeyInterceptor, load_api_keys
from service.api.errors import status_name
from service.api.gen.cadenza.v1 import tts_pb2
from service.api.google_tts import SERVICE_NAME as GOOGLE_SERVICE
from service.api.google_tts import add_google
from service.api.native import add_native
from service.api.ports import DEFAULT_HOST, DEFAULT_PORT, PortInUseError, check_port_free, host_port
from service.api.processes import ApiServers
from service.api.riva import add_riva
from service.engine.config import EngineConfig
from service.engine.contract import Engine, Unavailable
from service.engine.engine import TtsEngine
from service.engine.proc import ApiSlot, core_failed
from service.telemetry import Telemetry, TelemetryConfig

__all__ = ["CadenzaServer", "PortInUseError", "ServerConfig", "serve"]

log = logging.getLogger(__name__)


class _ClientGoneFilter(logging.Filter):
    """grpc's core logs an ERROR with a traceback when a stream's response is written after its
    client cancelled (the write races the cancellation). Nothing is wrong on our side and nothing
    can be done: keep it out of the operator's log (at most one DEBUG line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and type(exc).__name__ == "ExecuteBatchError":
            log.debug("a response was written after its client left (%s)", record.getMessage())
            return False
        return True


_CLIENT_GONE = _ClientGoneFilter()

NATIVE_SERVICE = tts_pb2.DESCRIPTOR.services_by_name["TextToSpeech"].full_name
RIVA_SERVICE = rtts.DESCRIPTOR.services_by_name["RivaSpeechSynthesis"].full_name
# The APIs served on the port: health answers for each of them (and for "", the whole server).
API_SERVICES = (NATIVE_SERVICE, RIVA_SERVICE, GOOGLE_SERVICE)
REFLECTION_V1_SERVICE = "grpc.reflection.v1.ServerReflection"
AddServicer = Callable[[grpc.aio.Server, Engine], None]


@dataclass(frozen=True)
class ServerConfig:
    host: str = DEFAULT_HOST  # loopback; another address without TLS or API keys logs a warning
    port: int = DEFAULT_PORT  # 0 picks a free port (see CadenzaServer.port)
    engine: EngineConfig = field(default_factory=EngineConfig)
    drain_grace_s: float = 30.0  # after SIGTERM, open sessions get this long to finish
    tls_cert: Path | None = None  # PEM certificate chain: serve TLS (needs tls_key)
    tls_key: Path | None = None  # PEM private key of tls_cert
    tls_client_ca: Path | None = None  # PEM CA bundle: mTLS, clients must present a certificate it signed
    api_keys_file: Path | None = None  # one key per line: every RPC but health and reflection needs one
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)  # metrics endpoint, OTLP, logs
    # API server processes on the one port (SO_REUSEPORT among themselves; the kernel spreads
    # connections over them), each with its own event loop and gRPC server, sharing one engine
    # core: one process's Python takes a burst of new streams in one after the other.
    api_servers: int = 1

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("a client CA (--tls-client-ca) needs TLS: give --tls-cert and --tls-key too")
        if not 1 <= self.api_servers <= 64:
            raise ValueError(f"API servers must be 1-64, not {self.api_servers} (--api-servers)")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


def is_loopback(host: str) -> bool:
    """Is `host` (as given to --host: a name, an IP, or [IPv6]) a loopback address?"""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if bare.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the PEM files (read now: a missing file fails before anything loads)."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    chain = Path(config.tls_cert).read_bytes()
    key = Path(config.tls_key).read_bytes()
    ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca is not None else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca, require_client_auth=ca is not None)


def _reflection_v1_file() -> None:
    """grpcio-reflection only ships v1alpha; grpc.reflection.v1 is the same protocol under another
    package. Put its descriptor in the default pool (so reflection can describe it too)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(REFLECTION_V1_SERVICE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = proto.package, "grpc.reflection.v1"
    proto.name = "grpc/reflection/v1/reflection.proto"
    proto.package = new
    proto.options.Clear()

    def rename(type_name: str) -> str:
        return type_name.replace(f".{old}.", f".{new}.", 1)

    for message in proto.message_type:
        for f in message.field:
            if f.type_name:
                f.type_name = rename(f.type_name)
    for method in proto.service[0].method:
        method.input_type = rename(method.input_type)
        method.output_type = rename(method.output_type)
    pool.Add(proto)


def _add_reflection(server: grpc.aio.Server, services: Sequence[str]) -> None:
    """Server reflection, v1alpha and v1 (one servicer: the messages are the same on the wire)."""
    _reflection_v1_file()
    names = [*services, reflection.SERVICE_NAME, REFLECTION_V1_SERVICE]
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1_SERVICE, {"ServerReflectionInfo": handler}),)
    )


class _Health(health.aio.HealthServicer):
    """Health that answers NOT_SERVING from the moment the engine is dead: whoever finds the
    core dead marks it so before failing any session, while setting the status (`set`) takes
    the event loop a turn or more, and a balancer must not send new streams meanwhile."""

    def __init__(self, dead: Callable[[], bool]) -> None:
        super().__init__()
        self._dead = dead

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
                    ) -> health_pb2.HealthCheckResponse:
        reply: health_pb2.HealthCheckResponse = await super().Check(request, context)
        if self._dead():
            reply.status = health_pb2.HealthCheckResponse.NOT_SERVING
        return reply


class CadenzaServer:
    """Owns the engine and the gRPC server. `start()`, then `wait()`; `drain()` on SIGTERM."""

    def __init__(self, config: ServerConfig, extra_servicers: Sequence[AddServicer] = (),
                 telemetry: Telemetry | None = None, slot: ApiSlot | None = None) -> None:
        """`telemetry`: where metrics and spans go (tests pass in-memory readers); None builds it
        from `config.telemetry` (the metrics endpoint listens from here on). `slot`: which of
        `config.api_servers` processes this is; None, the first (it starts the others, `ApiServers`)."""
        logging.getLogger("grpc._cython.cygrpc").addFilter(_CLIENT_GONE)  # idempotent: one filter object
        self.config = config
        self.slot = slot = slot or ApiSlot(0, config.api_servers)  # the first starts the core, a pipe each
        # Files first: a missing certificate or keys file fails before anything is loaded.
        self._credentials = _server_credentials(config)
        keys = load_api_keys(config.api_keys_file) if config.api_keys_file is not None else ()
        self._owns_telemetry = telemetry is None
        if telemetry is None:
            from service.telemetry.exporters import build_telemetry

            own = config.telemetry
            if slot.index > 0 and own.metrics_port is not None:  # summed into the first one's endpoint
                own = dataclasses.replace(own, metrics_host="127.0.0.1", metrics_port=0)
            telemetry = build_telemetry(own, config.host, status_of=status_name)
        elif telemetry.status_of is None:
            telemetry.status_of = status_name
        self.telemetry = telemetry
        self.engine = TtsEngine(config.engine, telemetry, slot)
        size = config.engine.limits.max_message_bytes
        from service.telemetry.rpc import RpcInterceptor

        interceptors: list[grpc.aio.ServerInterceptor] = [RpcInterceptor(telemetry)]
        if keys:
            interceptors.append(ApiKeyInterceptor(keys))
        # Port sharing only among this server's own processes: `bind` checks first that no other
        # process holds the port, so a second `cadenza serve` there still fails instead of taking
        # a share of the traffic.
        options = [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size),
                   ("grpc.so_reuseport", int(config.api_servers > 1))]
        self.server = grpc.aio.server(interceptors=interceptors, options=options)
        self.health = _Health(lambda: self.engine.dead)
        idle, stall = config.engine.limits.idle_timeout_s, config.engine.batch.stall_timeout_s
        add_native(self.server, self.engine, idle, stall)
        add_riva(self.server, self.engine, idle_timeout_s=idle, write_stall_s=stall)  # same port, same engine
        add_google(self.server, self.engine, idle_timeout_s=idle, write_stall_s=stall)
        for add in extra_servicers:
            add(self.server, self.engine)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        _add_reflection(self.server, [*API_SERVICES, health.SERVICE_NAME])
        self.others: ApiServers | None = None  # the first of several API servers: the other processes
        self.port = 0
        self._stopped = asyncio.Event()
        self.engine_failed = False  # the engine thread died; `serve` exits non-zero
        self._watcher: asyncio.Task[None] | None = None

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for service in ("", *API_SERVICES):
            await self.health.set(service, status)

    def bind(self) -> int:
        """Take the listening port (before anything slow): PortInUseError if it is taken (the
        other API server processes share the first one's)."""
        host, port = self.config.host, self.config.port
        if self.slot.index == 0:
            check_port_free(host, port)  # a clear error without grpc's own log line, in the usual case
        address = host_port(host, port)
        try:
            if self._credentials is not None:
                self.port = self.server.add_secure_port(address, self._credentials)
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
            check_port_free(host, port)
            raise OSError(f"cannot listen on {address} (--host, --port): {exc}") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {address} (--host, --port)")
        if self.slot.index == 0:
            self._warn_if_exposed()
        return self.port

    def _warn_if_exposed(self) -> None:
        config = self.config
        if is_loopback(config.host) or config.tls or config.api_keys_file is not None:
            return
        log.warning(
            "listening on %s in plaintext without API keys: anyone who can reach this address can "
            "synthesise through every API (native, Riva, Google) and read its traffic; secure it with "
            "--tls-cert/--tls-key (--tls-client-ca for client certificates) and/or --api-keys-file, "
            "or listen on loopback only (--host 127.0.0.1)", host_port(config.host, self.port),
        )

    async def start(self) -> None:
        """Listen at once (health says NOT_SERVING), load + warm up the voice, then SERVING."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if not self.port:
            self.bind()
        await self.server.start()
        await self.engine.start()
        if self.config.api_servers > 1 and self.slot.index == 0:  # the core is warm: start the others
            self.others = ApiServers(self.config, self.port, self.engine.server_conns, self.telemetry)
            await asyncio.get_running_loop().run_in_executor(None, self.others.start)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._watcher = asyncio.get_running_loop().create_task(self._watch_engine())
        if self.slot.index > 0:
            log.info("API server process %d of %d (pid %d) serving on port %d", self.slot.index + 1,
                     self.slot.count, os.getpid(), self.port)
        else:
            log.info("cadenza serving on port %d", self.port)

    async def _watch_engine(self, every_s: float = 0.1) -> None:
        """If the engine dies: NOT_SERVING (health checks say so at once, see `_Health`), every
        open session ends with UNAVAILABLE, stop."""
        while not self._stopped.is_set():
            if self.others is not None:
                self.others.check()
            if self.engine.dead:
                self.engine_failed = True
                await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
                self.engine.fail_all(core_failed())
                await self.stop()
                return
            await asyncio.sleep(every_s)

    async def drain(self) -> None:
        """No new sessions; open ones get `drain_grace_s` to finish; those still open then are cut
        with a status that says why (not gRPC's generic cancellation); then stop."""
        which = f"API server process {self.slot.index + 1} of {self.slot.count} " if self.slot.index else ""
        opened = self.engine.live_sessions
        log.info("%sdraining: %d open session(s), grace %.0f s", which, opened, self.config.drain_grace_s)
        self.engine.drain()
        if self.others is not None:
            self.others.drain()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_grace_s
        while self.engine.live_sessions and loop.time() < deadline:
            await asyncio.sleep(0.05)
        cut = self.engine.sessions()
        for session in cut:
            session.interrupt(Unavailable(
                f"the server is shutting down; reconnect to another replica ({session.setup.cursor.read_s:.1f} s "
                "of audio was sent on this stream)"))
        log.info("%sdrained: %d session(s) ended within the grace, %d cut at its end", which,
                 max(opened - len(cut), 0), len(cut))
        await self.stop()

    async def stop(self) -> None:
        if self._stopped.is_set():
            return
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()
        await self.server.stop(grace=1.0)
        if self.others is not None:  # the core stops after the last of them
            await asyncio.get_running_loop().run_in_executor(None, self.others.stop, self.config.drain_grace_s)
        if self.engine.ready:  # its thread runs from the end of loading on
            await self.engine.stop()
        self._close_telemetry()
        self._stopped.set()

    def _close_telemetry(self) -> None:
        """Flush the exporters and close the metrics endpoint (only what this server built)."""
        if self._owns_telemetry:
            self.telemetry.shutdown()

    async def abort(self) -> None:
        """Stop after a failed start: no grace, nothing left for the closing event loop."""
        await self.server.stop(grace=None)
        if self.others is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.others.stop, 0.0)
        if self.engine.ready:
            await self.engine.stop()
        self._close_telemetry()
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()


async def serve(config: ServerConfig, extra_servicers: Sequence[AddServicer] = (),
                on_ready: Callable[[CadenzaServer], None] | None = None, slot: ApiSlot | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain. The port is taken first (PortInUseError before any
    voice loads); a failed start stops the gRPC server and the engine before the error propagates,
    so nothing is left for the event loop to finish after it closes. A signal during start-up
    stops when the current loading step ends (there is nothing to drain); a second one at once.
    A second signal while draining also quits at once (exit status 130). Another API server
    process (`slot`) heeds SIGTERM only: the first one sends it when it drains."""
    server = CadenzaServer(config, extra_servicers, slot=slot)
    signals = (signal.SIGTERM, signal.SIGINT) if server.slot.index == 0 else (signal.SIGTERM,)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    main = asyncio.current_task()
    started = False
    interrupted = False

    def on_signal() -> None:
        nonlocal interrupted
        if started:
            if not tasks:
                tasks.add(loop.create_task(server.drain()))
            else:  # a second signal while draining: do not wait out the grace period
                log.warning("interrupted again while draining (%d open session(s)); quitting at once",
                            server.engine.live_sessions)
                os._exit(130)
        elif interrupted:  # a second signal: do not wait for the loading step to end
            log.warning("interrupted again during start-up; quitting at once")
            os._exit(130)
        elif main is not None:
            interrupted = True
            log.info("interrupted during start-up; stopping when the current step ends (again: quit at once)")
            main.cancel()

    try:
        server.bind()
        for sig in signals:
            loop.add_signal_handler(sig, on_signal)
        await server.start()
        started = True
        if on_ready is not None:
            on_ready(server)
        await server.wait()
        if server.engine_failed:
            log.critical("the engine thread died; exiting")
    except BaseException as exc:
        await server.abort()
        if interrupted and isinstance(exc, asyncio.CancelledError):
            return
        raise
    finally:
        if not interrupted:  # else kept while the loop waits for the loading step: a second signal quits
            for sig in signals:
                loop.remove_signal_handler(sig)
    if server.engine_failed:
        raise SystemExit(1)
