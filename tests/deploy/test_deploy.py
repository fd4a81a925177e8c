"""deploy/: the Dockerfiles linted by hadolint, every Kustomize overlay rendered by `kubectl kustomize`, its core
kinds validated offline by `kubernetes-validate --strict`, and the InferencePool against its CRD's schema.

Each tool is optional here: a test skips cleanly when its tool (or ../shared's CRD) is absent.
"""
from __future__ import annotations

import copy
import pathlib
import re
import shutil
import subprocess

import pytest

from tests.conftest import FIXTURES, ROOT

yaml = pytest.importorskip("yaml")

DEPLOY = ROOT / "deploy"
OVERLAYS = {  # overlay -> the kinds it renders
    "cpu": {"Deployment", "Service", "PodDisruptionBudget"},
    "cuda": {"Deployment", "Service", "PodDisruptionBudget"},
    "gateway": {"Deployment", "Service", "PodDisruptionBudget", "InferencePool", "HorizontalPodAutoscaler"},
    "keda": {"Deployment", "Service", "PodDisruptionBudget", "ScaledObject"},
}
CORE_KINDS = {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"}


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed")
    return path


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    kubectl = tool("kubectl")
    out = {}
    for overlay in OVERLAYS:
        result = subprocess.run([kubectl, "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        out[overlay] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


def one(docs: list[dict], kind: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_is_clean_at_the_warning_level_and_runs_the_server_as_pid_1_non_root(name):
    hadolint = tool("hadolint")
    path = DEPLOY / name
    result = subprocess.run([hadolint, "--failure-threshold", "warning", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    text = path.read_text()
    entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    assert entrypoint, "ENTRYPOINT must be in exec form so SIGTERM reaches the server"
    assert '"--host", "0.0.0.0"' in entrypoint.group(1)
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user and user[-1] not in ("root", "0")
    assert 'VOLUME ["/models"]' in text


def test_the_cpu_image_installs_the_cpu_torch_wheel_on_a_slim_base():
    text = (DEPLOY / "Dockerfile.cpu").read_text()
    assert re.search(r"^FROM python:[\d.]+-slim$", text, re.M)
    assert "--index-url https://download.pytorch.org/whl/cpu torch==" in text


def test_every_overlay_renders_its_kinds(rendered):
    for overlay, kinds in OVERLAYS.items():
        assert {d["kind"] for d in rendered[overlay]} == kinds, overlay


def test_core_kinds_validate_strictly_offline(rendered, tmp_path):
    validate = tool("kubernetes-validate")
    for overlay, docs in rendered.items():
        core = [d for d in docs if d["kind"] in CORE_KINDS]
        path = tmp_path / f"{overlay}.yaml"
        path.write_text(yaml.safe_dump_all(core))
        result = subprocess.run([validate, "--strict", str(path)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.count("passed") == len(core), result.stdout
    # strict means strict: an unknown field in the pod spec is refused
    bad = copy.deepcopy(one(rendered["cpu"], "Deployment"))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    result = subprocess.run([validate, "--strict", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "readinesProbe" in result.stdout + result.stderr


def strict(schema: object) -> object:
    """The CRD's schema with unknown fields refused, as the API server's strict field validation does."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def test_inference_pool_validates_against_the_crd_and_selects_the_pods(rendered):
    jsonschema = pytest.importorskip("jsonschema")
    crd_path = FIXTURES / "k8s" / "inferencepools.crd.yaml"
    if not crd_path.exists():
        pytest.skip(f"{crd_path} is absent")
    crd = yaml.safe_load(crd_path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    docs = rendered["gateway"]
    pool = one(docs, "InferencePool")
    assert pool["apiVersion"] == f"{crd['spec']['group']}/v1"
    jsonschema.validate(pool, schema)
    with pytest.raises(jsonschema.ValidationError):  # the schema has teeth
        jsonschema.validate({**pool, "spec": {k: v for k, v in pool["spec"].items() if k != "targetPorts"}}, schema)
    pod = one(docs, "Deployment")["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = [p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == ports


def test_probes_grace_period_and_shm_fit_the_server(rendered):
    for overlay, docs in rendered.items():
        spec = one(docs, "Deployment")["spec"]["template"]["spec"]
        container = spec["containers"][0]
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert container["startupProbe"]["httpGet"]["path"] == "/health"
        args = container["args"]
        assert "--metrics-compat=vllm" in args
        (timeout,) = [int(a.split("=")[1]) for a in args if a.startswith("--shutdown-timeout=")]
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert spec["terminationGracePeriodSeconds"] > pre_stop + timeout, overlay
        (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"mountPath": "/dev/shm", "name": "dshm"} in container["volumeMounts"]
        assert spec["securityContext"]["runAsNonRoot"] is True
    cuda = one(rendered["cuda"], "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert cuda["image"] == "rawserve:cuda" and cuda["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_autoscalers_scale_the_deployment_on_the_vllm_queue_gauge(rendered):
    scaled = one(rendered["keda"], "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "rawserve"
    assert "vllm:num_requests_waiting" in scaled["spec"]["triggers"][0]["metadata"]["query"]
    hpa = one(rendered["gateway"], "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "rawserve"}
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm:num_requests_waiting"


def server_configs(argv: list[str]):
    from rawserve.cli import parse_with_model
    from rawserve.config import build_parser, configs_from_args

    return configs_from_args(parse_with_model(build_parser(environ={}), argv))


def test_the_manifests_and_images_pass_flags_rawserve_has(rendered):
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (DEPLOY / name).read_text()
        entrypoint = yaml.safe_load(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
        cmd = yaml.safe_load(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
        assert entrypoint[:2] == ["rawserve", "serve"]
        engine, server = server_configs(entrypoint[2:] + cmd)
        assert server.host == "0.0.0.0" and engine.model_dir == "/models/model"
    for overlay, docs in rendered.items():
        engine, server = server_configs(one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"])
        assert server.metrics_compat == "vllm" and server.drain_timeout_s == 30, overlay
        assert engine.model_dir == "/models/model"
