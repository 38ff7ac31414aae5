"""The Helm chart: real helm renders it (default values and the ci/*-values.yaml sets), every
manifest validates against the Kubernetes schemas, bad values fail with a schema message naming
the value, and the rendered objects say what the README promises."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.cli import build_parser
from tests.deploy.tools import ROOT, tool

CHART = ROOT / "helm" / "cadenza"
VALUE_SETS = sorted((CHART / "ci").glob("*-values.yaml"))
ALL_SETS: list[Path | None] = [None, *VALUE_SETS]
SET_IDS = ["defaults", *(p.name for p in VALUE_SETS)]

Doc = dict[str, Any]


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("helm"), *args], capture_output=True, text=True, check=check, timeout=120)


def template_args(values: Path | None = None, sets: Sequence[str] = (), extra: Sequence[str] = ()) -> list[str]:
    args = ["template", "t", str(CHART), "--namespace", "speech", *extra]
    if values is not None:
        args += ["-f", str(values)]
    for s in sets:
        args += ["--set", s]
    return args


def render(*sets: str, values: Path | None = None, extra: Sequence[str] = ()) -> list[Doc]:
    out = helm(*template_args(values, sets, extra)).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def ci(name: str) -> Path:
    return CHART / "ci" / f"{name}-values.yaml"


def one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def pod_spec(docs: list[Doc]) -> Doc:
    return one(docs, "Deployment")["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def container(docs: list[Doc]) -> Doc:
    return pod_spec(docs)["containers"][0]  # type: ignore[no-any-return]


def serve_args(args: list[str]) -> Any:
    """Parsed with the real CLI parser: exits (SystemExit) on an unknown option or a bad value."""
    parsed = build_parser().parse_args(args)
    assert parsed.func.__name__ == "_cmd_serve"
    return parsed


def test_chart_declares_its_ci_value_sets() -> None:
    assert {p.name for p in VALUE_SETS} >= {"cpu-values.yaml", "gpu-values.yaml", "tls-apikeys-values.yaml",
                                             "autoscaling-values.yaml", "kokoro-values.yaml"}


@pytest.mark.parametrize("values", ALL_SETS, ids=SET_IDS)
def test_lint_strict(values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART)] + (["-f", str(values)] if values else [])
    done = helm(*args, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("values", ALL_SETS, ids=SET_IDS)
def test_every_manifest_validates_against_the_kubernetes_schemas(values: Path | None, tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(helm(*template_args(values)).stdout)
    done = subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", str(manifest)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # Only the Prometheus Operator's kind has no schema here (a CRD); anything else must validate.
    for line in (done.stdout + done.stderr).splitlines():
        assert "Couldn't find schema for kind ServiceMonitor" in line, line


@pytest.mark.parametrize("values", ALL_SETS, ids=SET_IDS)
def test_rendered_args_and_probe_commands_are_accepted_by_the_cli(values: Path | None) -> None:
    docs = render(values=values)
    c = container(docs)
    serve_args(c["args"])
    for init in pod_spec(docs).get("initContainers", []):
        assert build_parser().parse_args(init["args"]).func.__name__ == "_cmd_voices_install"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if "exec" in c[probe]:
            command = c[probe]["exec"]["command"]
            assert command[:2] == ["cadenza", "health"]
            assert build_parser().parse_args(command[1:]).func.__name__ == "_cmd_health"


@pytest.mark.parametrize("values", ALL_SETS, ids=SET_IDS)
def test_notes_render_with_the_address_and_the_balancing_advice(values: Path | None) -> None:
    args = ["install", "tts", str(CHART), "--namespace", "speech", "--dry-run=client"]
    notes = helm(*args, *(["-f", str(values)] if values else [])).stdout.split("NOTES:", 1)[1]
    assert "tts-cadenza.speech.svc:50051" in notes and "helm test tts" in notes
    several = values is not None and values.name in ("cpu-values.yaml", "autoscaling-values.yaml")
    assert ("round_robin" in notes) == several  # headless advice, or the hint to turn it on


def test_defaults_serve_the_builtin_voice_on_cpu_with_grpc_probes() -> None:
    docs = render()
    c = container(docs)
    assert sorted(d["kind"] for d in docs) == ["Deployment", "NetworkPolicy", "NetworkPolicy", "Pod", "Pod",
                                               "PodDisruptionBudget", "Service", "ServiceAccount"]
    assert c["args"][0] == "serve" and "--device=auto" in c["args"]
    assert "--host=[::]" in c["args"]  # the server's own default is loopback: unreachable through the Service
    assert "--max-message-bytes=4194304" in c["args"]  # integers render as integers
    assert "--preload" in c["args"] and "--cache-dir=/cache/onnx" in c["args"]
    assert "--metrics-port=9464" in c["args"]
    assert c["image"] == "cadenza:0.1.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": 50051}, probe  # grpc.health.v1 on the serving port
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "metrics": 9464}
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    spec = pod_spec(docs)
    assert "tolerations" not in spec and "nodeSelector" not in spec
    # No ServiceMonitor API in a plain `helm template`: scrape annotations instead.
    annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "9464"
    service = one(docs, "Service")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 50051, "metrics": 9464}
    assert service["spec"]["ports"][0]["appProtocol"] == "grpc"


@pytest.mark.parametrize("values", ALL_SETS, ids=SET_IDS)
def test_pods_run_locked_down(values: Path | None) -> None:
    docs = render(values=values)
    spec = pod_spec(docs)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    pods = [spec] + [d["spec"] for d in docs if d["kind"] == "Pod"]  # the helm test pods too
    for p in pods:
        for c in p["containers"] + p.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # Writable places on a read-only root: the export cache and /tmp, both emptyDirs.
    mounts = {m["mountPath"]: m["name"] for m in container(docs)["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/cache"]] and "emptyDir" in volumes[mounts["/tmp"]]


def test_gpu_mode_switches_the_image_and_asks_for_a_gpu_node() -> None:
    docs = render(values=ci("gpu"))
    c, spec = container(docs), pod_spec(docs)
    assert c["image"] == "registry.example.com/cadenza:0.1.0-cuda"
    assert "--device=cuda" in c["args"] and "--voices=/voices" in c["args"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["limits"]["memory"] == "16Gi"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert any(t["key"] == "dedicated" for t in spec["tolerations"])  # the user's own are kept
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true", "topology.kubernetes.io/zone": "zone-a"}
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["terminationGracePeriodSeconds"] == 60 + 5 + 15  # drain grace + preStop pause + time to exit
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["voices"]["persistentVolumeClaim"] == {"claimName": "piper-voices", "readOnly": True}
    # The acoustic stage compiled on request, and what inductor compiled kept in the cache volume.
    assert serve_args(c["args"]).compile_acoustic is False
    compiled = container(render("gpu.enabled=true", "server.compileAcoustic=true", "server.compileDecoder=true"))
    flags = serve_args(compiled["args"])
    assert flags.compile_acoustic is True and flags.compile_decoder is True
    assert serve_args(c["args"]).compile_decoder is False
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(
        next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "cache") + "/")
    # Without a gpuTag the CUDA image is <appVersion>-cuda; a digest wins over either tag.
    assert container(render("gpu.enabled=true"))["image"] == "cadenza:0.1.0-cuda"
    digest = "sha256:" + "a" * 64
    assert container(render("gpu.enabled=true", f"image.digest={digest}"))["image"] == f"cadenza@{digest}"


def test_kokoro_voices_are_fetched_by_an_init_container_into_the_served_voices_volume() -> None:
    docs = render(values=ci("kokoro"))
    spec, c = pod_spec(docs), container(docs)
    (init,) = spec["initContainers"]
    install = build_parser().parse_args(init["args"])
    served = serve_args(c["args"])
    assert (install.family, install.dir) == ("kokoro", "/voices")
    assert (served.voices_dir, served.voice) == ("/voices", "kokoro-af_heart")
    # The server's image, security context and writable places ($HOME, $TMPDIR on the /tmp emptyDir).
    assert (init["image"], init["securityContext"]) == (c["image"], c["securityContext"])
    server_env, init_env = ({e["name"]: e["value"] for e in x["env"]} for x in (c, init))
    assert {k: init_env[k] for k in ("HOME", "TMPDIR")} == {k: server_env[k] for k in ("HOME", "TMPDIR")}
    writes = {m["mountPath"]: m for m in init["volumeMounts"]}
    reads = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert set(writes) == {"/voices", "/tmp"} and not writes["/voices"].get("readOnly")
    assert writes["/voices"]["name"] == reads["/voices"]["name"] and reads["/voices"]["readOnly"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[reads["/voices"]["name"]]["emptyDir"] == {"sizeLimit": "512Mi"}
    assert "initContainers" not in pod_spec(render())  # off by default
    # Files in a claim are served as they are (installed there once); both at once is refused.
    claim = render("voices.existingClaim=kokoro-files")
    assert "initContainers" not in pod_spec(claim) and serve_args(container(claim)["args"]).voices_dir == "/voices"
    done = helm(*template_args(sets=["voices.kokoro.install=true", "voices.existingClaim=v"]), check=False)
    assert done.returncode != 0 and "voices.existingClaim" in done.stderr and "cadenza voices install" in done.stderr


def test_tls_and_api_keys_mount_the_secrets_and_probe_over_tls() -> None:
    docs = render(values=ci("tls-apikeys"))
    c, spec = container(docs), pod_spec(docs)
    args = serve_args(c["args"])
    assert (args.tls_cert, args.tls_key, args.tls_client_ca) == (
        "/etc/cadenza/tls/tls.crt", "/etc/cadenza/tls/tls.key", "/etc/cadenza/client-ca/ca.crt")
    assert args.api_keys_file == "/etc/cadenza/api-keys/keys.txt"
    volumes = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    assert volumes == {"tls": "cadenza-server-tls", "client-ca": "cadenza-client-ca",
                       "probe-client": "cadenza-probe-client-tls", "api-keys": "cadenza-keys"}
    assert not [d for d in docs if d["kind"] == "Secret"]  # existing secrets: the chart makes none
    probe = c["readinessProbe"]["exec"]["command"]
    assert "--tls-server-name=tts.example.com" in probe and "--tls-cert=/etc/cadenza/probe-client/tls.crt" in probe
    ingress = one(docs, "Ingress")
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPCS"
    assert ingress["spec"]["tls"][0]["secretName"] == "tts-example-com-tls"


def test_inline_tls_and_keys_make_their_secrets() -> None:
    docs = render("tls.enabled=true", "tls.certificate=CERT", "tls.key=KEY", "apiKeys.enabled=true",
                  "apiKeys.keys={k1,k2}")
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    assert secrets["t-cadenza-tls"]["type"] == "kubernetes.io/tls"
    assert set(secrets["t-cadenza-tls"]["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    import base64

    assert base64.b64decode(secrets["t-cadenza-api-keys"]["data"]["api-keys"]) == b"k1\nk2\n"
    assert serve_args(container(docs)["args"]).api_keys_file == "/etc/cadenza/api-keys/api-keys"
    done = helm(*template_args(sets=["tls.enabled=true"]), check=False)
    assert done.returncode != 0 and "tls.existingSecret" in done.stderr


def test_autoscaling_on_sessions_per_pod_with_a_cpu_fallback_and_a_service_monitor() -> None:
    docs = render(values=ci("autoscaling"))
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 10)
    pods, cpu = hpa["spec"]["metrics"]
    assert pods == {"type": "Pods", "pods": {"metric": {"name": "cadenza_sessions_active"},
                                             "target": {"type": "AverageValue", "averageValue": "4"}}}
    assert cpu["resource"] == {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 75}}
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert "replicas" not in one(docs, "Deployment")["spec"]  # the HPA owns the count
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert "annotations" not in one(docs, "Deployment")["spec"]["template"]["metadata"]  # no scrape annotations
    dashboard = one(docs, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["cadenza.json"]) == json.loads(
        (CHART / "dashboards" / "cadenza.json").read_text())


def test_service_monitor_follows_the_prometheus_operator_api() -> None:
    with_api = render(extra=["--api-versions", "monitoring.coreos.com/v1/ServiceMonitor"])
    assert one(with_api, "ServiceMonitor")
    assert not [d for d in render() if d["kind"] == "ServiceMonitor"]
    never = render("metrics.serviceMonitor.enabled=false", extra=["--api-versions",
                                                                  "monitoring.coreos.com/v1/ServiceMonitor"])
    assert not [d for d in never if d["kind"] == "ServiceMonitor"]
    off = render("metrics.enabled=false")
    assert "--metrics-port" not in " ".join(container(off)["args"])
    assert "annotations" not in one(off, "Deployment")["spec"]["template"]["metadata"]


@pytest.mark.parametrize("sets", [(), ("replicaCount=3",), ("autoscaling.enabled=true",)], ids=str)
def test_pdb_never_blocks_a_drain(sets: tuple[str, ...]) -> None:
    pdb = one(render(*sets), "PodDisruptionBudget")["spec"]
    assert "minAvailable" not in pdb and pdb["maxUnavailable"] >= 1


def test_network_policy_opens_only_the_grpc_and_metrics_ports() -> None:
    docs = render("networkPolicy.grpcFrom[0].namespaceSelector.matchLabels.team=voice")
    server = one(docs, "NetworkPolicy", "t-cadenza")["spec"]
    assert server["podSelector"]["matchLabels"] == one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    grpc, metrics = server["ingress"]
    assert grpc["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    assert grpc["from"] == [{"namespaceSelector": {"matchLabels": {"team": "voice"}}}]
    assert metrics["ports"] == [{"port": "metrics", "protocol": "TCP"}] and "from" not in metrics
    tests = one(docs, "NetworkPolicy", "t-cadenza-test")["spec"]
    assert tests["policyTypes"] == ["Ingress"] and "ingress" not in tests  # nothing connects to test pods
    # The test pods never match the server's selector (the Service must not route to them).
    selector = one(docs, "Service", "t-cadenza")["spec"]["selector"].items()
    for pod in (d for d in docs if d["kind"] == "Pod"):
        assert not selector <= pod["metadata"]["labels"].items()
        assert tests["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()


def test_headless_service_and_spread_for_client_side_balancing() -> None:
    docs = render(values=ci("cpu"))
    headless = one(docs, "Service", "t-cadenza-headless")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["ports"][0]["appProtocol"] == "grpc"
    spread = pod_spec(docs)["topologySpreadConstraints"]
    assert spread[0]["topologyKey"] == "kubernetes.io/hostname" and spread[0]["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread[0]["labelSelector"]["matchLabels"] == one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    assert one(docs, "Deployment")["spec"]["replicas"] == 2


@pytest.mark.parametrize(("sets", "message"), [
    (["replicaCount=two"], "/replicaCount"),
    (["server.maxSession=3"], "maxSession"),  # a typo of maxSessions
    (["resources=null"], "resources"),
    (["server.port=-1"], "/server/port"),
    (["metrics.port=-9464"], "/metrics/port"),
    (["service.port=70000"], "/service/port"),
    (["server.backend=tpu"], "/server/backend"),
    (["server.device=tpu"], "/server/device"),
    (["server.decoder=fast"], "/server/decoder"),
    (["server.precision=fp8"], "precision"),  # no such value: the server picks precision per request
    (["podDisruptionBudget.maxUnavailable=0"], "/podDisruptionBudget/maxUnavailable"),
    (["autoscaling.targetCPUUtilizationPercentage=150"], "/autoscaling/targetCPUUtilizationPercentage"),
    (["metrics.serviceMonitor.enabled=maybe"], "/metrics/serviceMonitor/enabled"),
    (["voices.kokoro.install=yes"], "/voices/kokoro/install"),
], ids=lambda v: v[0] if isinstance(v, list) else None)
def test_bad_values_fail_with_a_schema_message_naming_the_value(sets: list[str], message: str) -> None:
    done = helm(*template_args(sets=sets), check=False)
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr or "schema" in done.stderr
    assert message in done.stderr, done.stderr


def test_helm_test_pods_check_health_and_synthesise(tmp_path: Path) -> None:
    docs = render(values=ci("tls-apikeys"))
    tests = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Pod"}
    assert set(tests) == {"t-cadenza-test-health", "t-cadenza-test-synthesis"}
    for pod in tests.values():
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        assert pod["spec"]["restartPolicy"] == "Never"
    health = tests["t-cadenza-test-health"]["spec"]["containers"][0]["command"]
    parsed = build_parser().parse_args(health[1:])
    assert parsed.addr == "t-cadenza.speech.svc:50051" and parsed.tls_server_name == "tts.example.com"
    # The synthesis script, run with a stand-in `cadenza` that records its arguments: it sends the
    # first key of the keys file and checks that audio came back.
    script = tests["t-cadenza-test-synthesis"]["spec"]["containers"][0]["args"][0]
    keys = tmp_path / "keys.txt"
    keys.write_text("# rotated weekly\n\n  first-key\nsecond-key\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "cadenza"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$CADENZA_API_KEY" "$@" > "$RECORD"\n'
                    'head -c 2000 /dev/zero > /tmp/test.wav\n')
    fake.chmod(0o755)
    record = tmp_path / "record"
    script = script.replace("/etc/cadenza/api-keys/keys.txt", str(keys))
    done = subprocess.run(["/bin/sh", "-ec", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(record)})
    assert done.returncode == 0, done.stderr
    key, *argv = record.read_text().splitlines()
    assert key.strip() == "first-key"
    parsed = build_parser().parse_args(argv)
    assert parsed.func.__name__ == "_cmd_client" and parsed.addr == "t-cadenza.speech.svc:50051"
    assert parsed.tls_ca == "/etc/cadenza/tls/ca.crt" and parsed.tls_cert == "/etc/cadenza/probe-client/tls.crt"
    assert shlex.split(script.splitlines()[-2])[0] == "cadenza"


def test_values_defaults_are_the_servers_own() -> None:
    """Each server default in values.yaml equals the dataclass default, written once there; the
    chart differs only where a deployment should (preload, metrics), and says so in values.yaml."""
    from service.api.server import ServerConfig
    from service.engine.config import BatchConfig, EngineConfig, Limits
    from service.telemetry.config import TelemetryConfig

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    server = values["server"]
    batch, limits, engine, config = BatchConfig(), Limits(), EngineConfig(), ServerConfig()
    assert (server["stepFrames"], server["maxStepRows"], server["stepFillRows"], server["slots"], server["decoder"]) \
        == (batch.step_frames, batch.max_step_rows, batch.step_fill_rows, batch.slots, batch.decoder)
    assert (server["maxAheadSeconds"], server["admissionWaitSeconds"]) == (batch.max_ahead_s, limits.admission_wait_s)
    assert server["stallTimeoutSeconds"] == batch.stall_timeout_s
    assert server["compileAcoustic"] is batch.compile_acoustic and server["compileDecoder"] is batch.compile_decoder
    assert server["int8"] is engine.int8
    assert (server["maxSessions"], server["maxTextChars"], server["maxMessageBytes"], server["idleTimeoutSeconds"]) \
        == (limits.max_sessions, limits.max_text_chars, limits.max_message_bytes, limits.idle_timeout_s)
    assert (server["device"], server["backend"], server["cacheMb"] << 20, server["core"]) == (
        engine.device, engine.backend, engine.cache_bytes, engine.core)
    assert (server["threads"] or None, server["capacity"] or None, server["voice"] or None) == (
        engine.threads, limits.capacity_streams, engine.voice)
    assert (server["drainGraceSeconds"], server["apiServers"]) == (config.drain_grace_s, config.api_servers)
    # Deliberate differences, each explained in values.yaml.
    assert server["preload"] is True and engine.preload is False
    assert values["metrics"]["enabled"] is True and TelemetryConfig().metrics_port is None
    assert "Differs from the server" in (CHART / "values.yaml").read_text()


def test_every_value_is_in_the_schema() -> None:
    """values.schema.json covers every value (objects closed with additionalProperties: false)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(value: Any, node: dict[str, Any], path: str) -> None:
        if isinstance(value, dict) and node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, path
            for key, item in value.items():
                assert key in node["properties"], f"{path}.{key} is not in values.schema.json"
                walk(item, node["properties"][key], f"{path}.{key}")

    walk(values, schema, "")
