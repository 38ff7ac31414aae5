"""The Helm chart renders valid Kubernetes manifests (real helm; schemas checked offline)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "cadenza"
HELM = shutil.which("helm")
pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not on PATH (.ci/run installs it)")


def render(*sets: str) -> list[dict]:  # type: ignore[type-arg]
    args = [str(HELM), "template", "t", str(CHART)]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def container(docs: list[dict]) -> dict:  # type: ignore[type-arg]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def test_lint() -> None:
    subprocess.run([str(HELM), "lint", str(CHART)], check=True, capture_output=True)


def test_defaults_serve_the_builtin_voice_on_cpu_with_grpc_probes() -> None:
    docs = render()
    c = container(docs)
    assert c["args"][0] == "serve" and "--device=auto" in c["args"]
    assert "--host=[::]" in c["args"]  # the server's own default is loopback: unreachable through the Service
    assert c["readinessProbe"]["grpc"]["port"] == 50051
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert "--max-message-bytes=4194304" in c["args"]  # integers render as integers
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Deployment", "PodDisruptionBudget", "Service"]


def test_gpu_and_voices_values() -> None:
    docs = render("gpu.enabled=true", "voices.existingClaim=my-voices", "server.drainGraceSeconds=60")
    c = container(docs)
    assert "--device=cuda" in c["args"] and "--voices=/voices" in c["args"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    spec = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] == 75  # drain grace + time to exit
    assert spec["volumes"][0]["persistentVolumeClaim"]["claimName"] == "my-voices"


def test_manifests_validate_against_kubernetes_schemas(tmp_path: Path) -> None:
    kv = shutil.which("kubernetes-validate")
    if kv is None:
        pytest.skip("kubernetes-validate is not installed")
    for i, sets in enumerate([(), ("gpu.enabled=true", "voices.existingClaim=v")]):
        manifest = tmp_path / f"m{i}.yaml"
        args = [str(HELM), "template", "t", str(CHART)] + [x for s in sets for x in ("--set", s)]
        manifest.write_text(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
        subprocess.run([kv, "--strict", str(manifest)], check=True, capture_output=True)


def test_rendered_args_are_accepted_by_cadenza_serve() -> None:
    """The chart passes only options `cadenza serve` knows, with values it accepts."""
    from service.cli import build_parser

    for sets in [(), ("gpu.enabled=true", "voices.existingClaim=v", "server.voice=x", "server.threads=2")]:
        args = container(render(*sets))["args"]
        parsed = build_parser().parse_args(args)  # exits (SystemExit) on an unknown option or a bad value
        assert parsed.func.__name__ == "_cmd_serve"


def test_values_defaults_are_the_servers_own() -> None:
    """Each default in values.yaml equals the server's dataclass default, written once there."""
    from service.engine.config import BatchConfig, Limits

    server = yaml.safe_load((CHART / "values.yaml").read_text())["server"]
    batch, limits = BatchConfig(), Limits()
    assert (server["stepFrames"], server["maxStepRows"], server["slots"]) == (
        batch.step_frames, batch.max_step_rows, batch.slots)
    assert (server["maxAheadSeconds"], server["admissionWaitSeconds"]) == (batch.max_ahead_s, limits.admission_wait_s)
    assert (server["maxSessions"], server["maxTextChars"], server["maxMessageBytes"], server["idleTimeoutSeconds"]) \
        == (limits.max_sessions, limits.max_text_chars, limits.max_message_bytes, limits.idle_timeout_s)
