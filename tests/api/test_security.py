"""Transport security and access: TLS, mTLS, API keys, the loopback default, reflection and health
for every service, and a second signal during drain. Real servers; certificates made in the test."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from service.api.auth import UNAUTHENTICATED_MESSAGE, ApiKeyInterceptor, load_api_keys
from service.api.client import connect, stream
from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.ports import DEFAULT_HOST, host_port
from service.api.server import CadenzaServer, ServerConfig, is_loopback
from service.cli import build_parser, main
from service.engine.config import BatchConfig, EngineConfig, Limits
from tests.api.native_server import ServerThread
from tests.serve_process import json_lines, start_serve, stop_process

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
KEY = "s3cret-key-Zq9XvT4w"  # looked for in the log: it must never appear there
OTHER_KEY = "second-key-0000"
SERVICES = ("cadenza.v1.TextToSpeech", "nvidia.riva.tts.RivaSpeechSynthesis",
            "google.cloud.texttospeech.v1.TextToSpeech", "grpc.health.v1.Health")
REFLECTION = ("grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection")


# --- certificates -------------------------------------------------------------------------------------


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing here


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _ca(common: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(_name(common))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(common: str, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
          server: bool) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        usage = x509.oid.ExtendedKeyUsageOID.SERVER_AUTH
    else:
        usage = x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH
    builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = _ca("cadenza test CA")
    server_key, server_cert = _leaf("localhost", ca_key, ca_cert, server=True)
    client_key, client_cert = _leaf("test client", ca_key, ca_cert, server=False)
    _, other_cert = _ca("unrelated CA")
    return Pki(
        ca=_write_cert(d / "ca.pem", ca_cert),
        server_cert=_write_cert(d / "server.pem", server_cert), server_key=_write_key(d / "server.key", server_key),
        client_cert=_write_cert(d / "client.pem", client_cert), client_key=_write_key(d / "client.key", client_key),
        other_ca=_write_cert(d / "other-ca.pem", other_cert),
    )


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"# Cadenza API keys\n\n  {KEY}  \n# retired: old-key\n{OTHER_KEY}\n")
    return path


# --- servers ------------------------------------------------------------------------------------------


def _config(**security: object) -> ServerConfig:
    return ServerConfig(
        host="127.0.0.1", port=0, drain_grace_s=1.0,
        engine=EngineConfig(limits=Limits(max_sessions=8, idle_timeout_s=5.0),
                            voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu", threads=1,
                            batch=BatchConfig(), cache_bytes=0),
        **security,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def tls_server(pki: Pki, keys_file: Path) -> Iterator[ServerThread]:
    """TLS (no client certificates) and API keys."""
    s = ServerThread(_config(tls_cert=pki.server_cert, tls_key=pki.server_key, api_keys_file=keys_file))
    yield s
    s.close()


@pytest.fixture(scope="module")
def mtls_server(pki: Pki) -> Iterator[ServerThread]:
    s = ServerThread(_config(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca))
    yield s
    s.close()


@pytest.fixture(scope="module")
def keys_server(keys_file: Path) -> Iterator[ServerThread]:
    """Plaintext with API keys."""
    s = ServerThread(_config(api_keys_file=keys_file))
    yield s
    s.close()


def _synthesize(addr: str, metadata: tuple[tuple[str, str], ...] | None = None, **tls: Path) -> bytes:
    channel, stub = connect(addr, **tls)  # type: ignore[arg-type]
    try:
        r = stream(stub, pb.SessionConfig(seed=1), ["Hello there."], timeout=30, metadata=metadata)
        assert r.summary is not None
        return r.audio
    finally:
        channel.close()


def _bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


# --- TLS and mTLS -------------------------------------------------------------------------------------


def test_tls_round_trip(tls_server: ServerThread, pki: Pki) -> None:
    audio = _synthesize(tls_server.addr, _bearer(KEY), tls_ca=pki.ca)
    assert len(audio) > 1000


@pytest.mark.parametrize("how", ["plaintext", "unknown CA"])
def test_tls_refuses_clients_that_cannot_verify_it(tls_server: ServerThread, pki: Pki, how: str) -> None:
    tls = {} if how == "plaintext" else {"tls_ca": pki.other_ca}
    with pytest.raises(grpc.RpcError) as err:
        _synthesize(tls_server.addr, _bearer(KEY), **tls)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_cli_client_with_tls_and_api_key(tls_server: ServerThread, pki: Pki, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tls.wav"
    base = ["client", "Secure hello.", "-o", str(out), "--addr", f"localhost:{tls_server.server.port}",
            "--tls-ca", str(pki.ca)]
    assert main([*base, "--api-key", KEY]) == 0
    assert out.stat().st_size > 1000
    assert main(base) == 1  # no key
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_mtls_serves_a_client_with_a_certificate(mtls_server: ServerThread, pki: Pki) -> None:
    audio = _synthesize(mtls_server.addr, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key)
    assert len(audio) > 1000


def test_mtls_refuses_a_client_without_a_certificate(mtls_server: ServerThread, pki: Pki) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _synthesize(mtls_server.addr, tls_ca=pki.ca)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_config_needs_cert_and_key(pki: Pki) -> None:
    with pytest.raises(ValueError, match="--tls-key"):
        ServerConfig(tls_cert=pki.server_cert)
    with pytest.raises(ValueError, match="--tls-client-ca"):
        ServerConfig(tls_client_ca=pki.ca)


# --- API keys -----------------------------------------------------------------------------------------


def test_load_api_keys(keys_file: Path, tmp_path: Path) -> None:
    assert load_api_keys(keys_file) == (KEY, OTHER_KEY)
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="no API keys"):
        load_api_keys(empty)
    assert KEY not in repr(ApiKeyInterceptor([KEY]))


@pytest.mark.parametrize("metadata", [
    None,
    _bearer("wrong-key"),
    _bearer(KEY + "x"),
    _bearer(KEY[:-1]),
    (("authorization", KEY),),  # no scheme
    (("authorization", f"Basic {KEY}"),),
    (("x-api-key", KEY),),
], ids=["none", "wrong", "longer", "prefix", "no-scheme", "basic", "other-header"])
def test_calls_without_a_known_key_are_unauthenticated(keys_server: ServerThread, metadata: object) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _synthesize(keys_server.addr, metadata)  # type: ignore[arg-type]
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert err.value.details() == UNAUTHENTICATED_MESSAGE


def test_every_api_and_shape_needs_a_key(keys_server: ServerThread) -> None:
    channel = grpc.insecure_channel(keys_server.addr)
    try:
        paths = ["/cadenza.v1.TextToSpeech/ListVoices",  # unary
                 "/nvidia.riva.tts.RivaSpeechSynthesis/Synthesize",
                 "/google.cloud.texttospeech.v1.TextToSpeech/ListVoices"]
        for path in paths:
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(path)(b"\xff\xff garbage", timeout=10)  # undecodable: still UNAUTHENTICATED
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, path
        with pytest.raises(grpc.RpcError) as err:  # unary request, streamed response
            list(channel.unary_stream("/cadenza.v1.TextToSpeech/Synthesize")(b"", timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        channel.close()


@pytest.mark.parametrize("key", [KEY, OTHER_KEY])
def test_a_known_key_is_served(keys_server: ServerThread, key: str) -> None:
    assert len(_synthesize(keys_server.addr, _bearer(key))) > 1000
    # the scheme is case-insensitive
    assert len(_synthesize(keys_server.addr, (("authorization", f"bearer {key}"),))) > 1000


def test_health_and_reflection_need_no_key(keys_server: ServerThread) -> None:
    channel = grpc.insecure_channel(keys_server.addr)
    try:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert set(SERVICES) <= _listed(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo)
    finally:
        channel.close()


def test_keys_never_logged(keys_server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    _synthesize(keys_server.addr, _bearer(KEY))
    with pytest.raises(grpc.RpcError):
        _synthesize(keys_server.addr, _bearer(KEY + "-wrong"))
    with pytest.raises(grpc.RpcError):
        _synthesize(keys_server.addr)
    # One line per refusal (README: one per failed RPC), with the method and why, never the key.
    refusals = [r for r in caplog.records if "UNAUTHENTICATED" in r.getMessage()]
    assert [(r.name, r.levelno, r.getMessage()) for r in refusals] == [
        ("service.api.errors", logging.INFO,
         "cadenza.v1.TextToSpeech/StreamingSynthesize failed: UNAUTHENTICATED: unknown API key"),
        ("service.api.errors", logging.INFO, "cadenza.v1.TextToSpeech/StreamingSynthesize failed: UNAUTHENTICATED: "
                                             "no API key ('authorization: Bearer <key>' metadata)"),
    ]
    assert KEY not in caplog.text and OTHER_KEY not in caplog.text


def test_json_log_is_json_on_every_stderr_line_with_tls(pki: Pki, keys_file: Path, tmp_path: Path) -> None:
    """`--log-format json`: gRPC's C core writes a failed TLS handshake (a plaintext client) straight
    to fd 2; that line is JSON too, as is the refusal of a call without a key (which names no key)."""
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server, port = start_serve("--voices", str(DATA), "--voice", "tiny-multi", "--backend", "torch",
                                   "--device", "cpu", "--threads", "1", "--log-format", "json",
                                   "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                                   "--api-keys-file", str(keys_file), stderr=out)
        try:
            with pytest.raises(grpc.RpcError) as err:  # plaintext to a TLS port: the handshake fails
                _synthesize(f"127.0.0.1:{port}", _bearer(KEY))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as err:
                _synthesize(f"localhost:{port}", _bearer(KEY + "-wrong"), tls_ca=pki.ca)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)
    text = log.read_text()
    records = json_lines(text)
    assert any("Handshake failed" in r["message"] and r["logger"] == "stderr" for r in records), text
    (refused,) = [r for r in records if r.get("status") == "UNAUTHENTICATED"]
    assert refused["message"] == "cadenza.v1.TextToSpeech/StreamingSynthesize failed: UNAUTHENTICATED: unknown API key"
    assert refused["level"] == "INFO" and refused["rpc"] == "cadenza.v1.TextToSpeech/StreamingSynthesize"
    assert KEY not in text


# --- reflection and health ----------------------------------------------------------------------------


def _listed(info: grpc.StreamStreamMultiCallable) -> set[str]:
    answer = next(iter(info(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)))
    return {s.name for s in answer.list_services_response.service}


def _v1_info(channel: grpc.Channel) -> grpc.StreamStreamMultiCallable:
    """grpc.reflection.v1: the same messages as v1alpha (grpcio-reflection ships no v1 stub)."""
    return channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )


def test_reflection_v1_and_v1alpha_list_every_service(keys_server: ServerThread) -> None:
    channel = grpc.insecure_channel(keys_server.addr)
    try:
        for info in (reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo, _v1_info(channel)):
            assert _listed(info) == {*SERVICES, *REFLECTION}
        for symbol in ("nvidia.riva.tts.RivaSpeechSynthesis", "cadenza.v1.TextToSpeech",
                       "grpc.reflection.v1.ServerReflection"):
            request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
            answer = next(iter(_v1_info(channel)(iter([request]), timeout=10)))
            assert answer.HasField("file_descriptor_response"), (symbol, answer.error_response)
    finally:
        channel.close()


def test_health_answers_for_every_service(keys_server: ServerThread) -> None:
    channel = grpc.insecure_channel(keys_server.addr)
    health = health_pb2_grpc.HealthStub(channel)
    try:
        for name in ("", *SERVICES[:3]):
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING, name
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        channel.close()


def test_health_of_an_unknown_service_names_the_ones_there_are(keys_server: ServerThread,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health", "--addr", keys_server.addr, "--service", "bogus"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"cadenza: error: {keys_server.addr} has no service 'bogus'; it has {', '.join(sorted(SERVICES[:3]))} "
        "(or leave --service out for the whole server)")


# --- bind address -------------------------------------------------------------------------------------


def test_an_ipv6_literal_host_is_bracketed_for_grpc() -> None:
    assert host_port("::1", 50051) == "[::1]:50051"
    assert host_port("::", 0) == "[::]:0"
    assert host_port("[::]", 0) == "[::]:0"  # given in brackets already
    assert host_port("127.0.0.1", 50051) == "127.0.0.1:50051"
    assert host_port("localhost", 1) == "localhost:1"


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_serve_on_the_ipv6_loopback(capsys: pytest.CaptureFixture[str]) -> None:
    server, port = start_serve("--host", "::1", "--voice", str(DATA / "tiny-multi.onnx"), "--device", "cpu",
                               "--threads", "1")
    try:
        assert main(["health", "--addr", f"[::1]:{port}"]) == 0
        assert capsys.readouterr().out.strip() == f"[::1]:{port}: SERVING"
    finally:
        stop_process(server)


def test_the_default_address_is_loopback() -> None:
    assert DEFAULT_HOST == "127.0.0.1" == ServerConfig().host
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "[::1]", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "[::]", "::", "10.1.2.3", "example.org"]))


def _bind_warnings(caplog: pytest.LogCaptureFixture, config: ServerConfig) -> list[str]:
    async def bind() -> None:
        server = CadenzaServer(config)
        try:
            server.bind()
        finally:
            await server.abort()

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="service.api.server"):
        asyncio.run(bind())
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_warns_when_exposed_without_tls_or_keys(caplog: pytest.LogCaptureFixture, keys_file: Path, pki: Pki) -> None:
    exposed = _bind_warnings(caplog, ServerConfig(host="0.0.0.0", port=0))
    assert len(exposed) == 1
    assert "0.0.0.0" in exposed[0] and "--tls-cert" in exposed[0] and "--api-keys-file" in exposed[0]
    assert _bind_warnings(caplog, ServerConfig(host="127.0.0.1", port=0)) == []
    assert _bind_warnings(caplog, ServerConfig(host="0.0.0.0", port=0, api_keys_file=keys_file)) == []
    assert _bind_warnings(caplog, ServerConfig(host="0.0.0.0", port=0, tls_cert=pki.server_cert,
                                               tls_key=pki.server_key)) == []


# --- signals ------------------------------------------------------------------------------------------


def test_second_sigterm_during_drain_quits_at_once(tmp_path: Path) -> None:
    server, port = start_serve("--voices", str(DATA), "--voice", "tiny-multi", "--backend", "torch", "--device", "cpu",
                               "--threads", "1", "--drain-grace", "30", "--idle-timeout", "120")
    lines: list[str] = []
    try:
        channel, stub = connect(f"127.0.0.1:{port}")
        release = threading.Event()

        def requests() -> Iterator[pb.StreamingSynthesizeRequest]:
            yield pb.StreamingSynthesizeRequest(config=pb.SessionConfig(seed=1))
            yield pb.StreamingSynthesizeRequest(text="A stream that stays open. ")
            yield pb.StreamingSynthesizeRequest(flush=True)
            release.wait(60)  # never ends its input: the session stays open through the drain

        responses = stub.StreamingSynthesize(requests(), timeout=60)
        first = next(responses)  # the session is live
        assert first.WhichOneof("response") is not None
        server.send_signal(signal.SIGTERM)
        for line in server.stdout:
            lines.append(line)
            if "draining" in line:
                break
        assert "1 open session" in lines[-1], "".join(lines)
        time.sleep(0.3)
        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=5)
        assert time.monotonic() - started < 3
        assert code != 0
        release.set()
        channel.close()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_bench_load_over_tls_with_an_api_key(tls_server: ServerThread, pki: Pki, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`cadenza bench load` drives a secured server (TLS + API key); the key never reaches its
    JSON report, and without the key it stops with one clear error line."""
    report = tmp_path / "load.json"
    base = ["bench", "load", "--target", f"localhost:{tls_server.server.port}", "--sessions", "2",
            "--tls-ca", str(pki.ca), "--connect-timeout", "20"]
    assert main([*base, "--api-key", KEY, "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("pass_rate=1.000"), out
    assert KEY not in report.read_text()
    assert main(base) == 1
    err = capsys.readouterr().err
    assert "UNAUTHENTICATED" in err and "Traceback" not in err, err
