"""The chart's TLS exec probe, run as rendered against a real mutual-TLS server with API keys:
`cadenza health` checks the certificate against tls.serverName (not the dialled 127.0.0.1) and
presents the probe's client certificate; health needs no API key."""

from __future__ import annotations

import datetime
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from service.api.server import ServerConfig
from service.engine.config import EngineConfig
from tests.api.native_server import ServerThread
from tests.api.test_security import _ca, _name, _write_cert, _write_key
from tests.deploy.tools import ROOT, tool

DATA = ROOT / "tests" / "data"
CHART = ROOT / "helm" / "cadenza"
SERVER_NAME = "tts.example.com"


def leaf(common: str, sans: list[str], ca: tuple, usage: x509.ObjectIdentifier) -> tuple:  # type: ignore[type-arg]
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in sans]), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """What the chart mounts under /etc/cadenza, as local files."""
    d = tmp_path_factory.mktemp("etc-cadenza")
    ca = _ca("cadenza probe test CA")
    server_key, server_cert = leaf(SERVER_NAME, [SERVER_NAME], ca, x509.oid.ExtendedKeyUsageOID.SERVER_AUTH)
    client_key, client_cert = leaf("kubelet probe", [], ca, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH)
    keys = d / "api-keys"
    keys.write_text("only-key\n")
    return {
        "/etc/cadenza/tls/ca.crt": _write_cert(d / "ca.crt", ca[1]),
        "/etc/cadenza/tls/tls.crt": _write_cert(d / "tls.crt", server_cert),
        "/etc/cadenza/tls/tls.key": _write_key(d / "tls.key", server_key),
        "/etc/cadenza/client-ca/ca.crt": d / "ca.crt",
        "/etc/cadenza/probe-client/tls.crt": _write_cert(d / "client.crt", client_cert),
        "/etc/cadenza/probe-client/tls.key": _write_key(d / "client.key", client_key),
        "/etc/cadenza/api-keys/keys.txt": keys,
    }


@pytest.fixture(scope="module")
def server(files: dict[str, Path]) -> Iterator[ServerThread]:
    s = ServerThread(ServerConfig(
        host="127.0.0.1", port=0, tls_cert=files["/etc/cadenza/tls/tls.crt"],
        tls_key=files["/etc/cadenza/tls/tls.key"], tls_client_ca=files["/etc/cadenza/client-ca/ca.crt"],
        api_keys_file=files["/etc/cadenza/api-keys/keys.txt"],
        engine=EngineConfig(voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu", threads=1,
                            cache_bytes=0)))
    yield s
    s.close()


def rendered_probe() -> list[str]:
    values = CHART / "ci" / "tls-apikeys-values.yaml"
    out = subprocess.run([tool("helm"), "template", "t", str(CHART), "-f", str(values),
                          "--set", f"tls.serverName={SERVER_NAME}"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    deployment = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment")
    command: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    return command


def localised(command: list[str], files: dict[str, Path], port: int) -> list[str]:
    out = []
    for arg in command[1:]:
        for mounted, local in files.items():
            arg = arg.replace(mounted, str(local))
        out.append(arg.replace("127.0.0.1:50051", f"127.0.0.1:{port}"))
    return [sys.executable, "-m", "service.cli", *out]


def test_the_rendered_tls_probe_passes_against_a_mutual_tls_server(server: ServerThread,
                                                                   files: dict[str, Path]) -> None:
    command = localised(rendered_probe(), files, server.server.port)
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip().endswith("SERVING"), done


def test_the_probe_fails_without_its_client_certificate_or_with_the_wrong_name(
    server: ServerThread, files: dict[str, Path],
) -> None:
    command = localised(rendered_probe(), files, server.server.port)
    without_cert = [a for a in command if not a.startswith(("--tls-cert", "--tls-key"))]
    wrong_name = [a.replace(SERVER_NAME, "other.example.com") for a in command]
    for bad in (without_cert, wrong_name):
        done = subprocess.run(bad, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 1 and "UNAVAILABLE" in done.stderr, done
