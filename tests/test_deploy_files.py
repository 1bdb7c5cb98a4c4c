"""The deployment files are valid and agree with the server: the Kubernetes manifests against the Kubernetes API
schemas (kubernetes-validate, strict), the Dockerfile through hadolint, deploy/haproxy.cfg through `haproxy -c`,
and the settings they share (ports, probes, grace period vs shutdown timeout, the HPA's metric) with voxgate."""

import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from gateway.cli import _parser
from gateway.config_file import config_tokens, subparser
from gateway.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.37.0"


def _manifests() -> dict[tuple[str, str], dict]:
    docs = [d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _tool(name: str) -> str:
    """A command-line tool from the test venv (pip packages put theirs beside the interpreter) or the PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is not installed (scripts/setup.sh test installs it)"
    return found


def test_kubernetes_manifests_match_the_api_schemas():
    manifests = _manifests()
    assert {kind for kind, _ in manifests} >= {"Deployment", "Service", "PodDisruptionBudget",
                                               "HorizontalPodAutoscaler", "ConfigMap", "StatefulSet"}
    for doc in manifests.values():
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    broken = manifests[("Deployment", "voxgate")]
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_deployment_agrees_with_the_server(tmp_path):
    manifests = _manifests()
    pod = manifests[("Deployment", "voxgate")]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    config_file = tmp_path / "voxgate.toml"
    config_file.write_text(manifests[("ConfigMap", "voxgate-config")]["data"]["voxgate.toml"])
    settings = _parser().parse_args(["serve", *config_tokens(config_file, subparser(_parser(), "serve"))])

    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["ports"][0]["containerPort"] == settings.port
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    pre_stop_s = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop_s + settings.shutdown_timeout
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert f"--config={mounts['config']}" in container["args"]
    assert "secret" in volumes["api-keys"] and any(a.startswith(f"--api-keys-file={mounts['api-keys']}/")
                                                  for a in container["args"])
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and mounts["dshm"] == "/dev/shm"

    labels = pod["metadata"]["labels"]
    for kind, name in (("Service", "voxgate"), ("PodDisruptionBudget", "voxgate")):
        spec = manifests[(kind, name)]["spec"]
        selector = spec["selector"].get("matchLabels", spec["selector"])
        assert selector.items() <= labels.items(), f"{kind} {name} does not select the voxgate pods"
    hpa = manifests[("HorizontalPodAutoscaler", "voxgate")]["spec"]
    metric = hpa["metrics"][0]["pods"]["metric"]["name"]
    exported = {m.name for m in GatewayMetrics().registry.collect()}
    assert metric in exported, f"the HPA scales on {metric}, which the gateway does not export"
    assert float(hpa["metrics"][0]["pods"]["target"]["averageValue"]) < settings.max_sessions


def test_the_dockerfile_passes_hadolint(tmp_path):
    hadolint = _tool("hadolint")
    config = ROOT / "deploy" / "hadolint.yaml"
    run = subprocess.run([hadolint, "--no-color", "--config", str(config), str(ROOT / "Dockerfile")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN cd /tmp && apt-get install -y curl\nCMD voxgate serve\n")
    run = subprocess.run([hadolint, "--no-color", "--config", str(config), str(bad)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode != 0 and "DL3007" in run.stdout  # the linter does look: `latest` is flagged


def test_the_dockerfile_runs_voxgate_as_a_user_from_its_config_file():
    lines = [line.split(None, 1) for line in (ROOT / "Dockerfile").read_text().splitlines()
             if line.strip() and not line.startswith(("#", " "))]
    instructions = [(word.upper(), rest) for word, rest in lines]
    bases = [rest for word, rest in instructions if word == "FROM"]
    cuda_arg = next(rest for word, rest in instructions if word == "ARG" and rest.startswith("CUDA_IMAGE="))
    assert "nvidia/cuda:" in cuda_arg and "runtime" in cuda_arg and all("${CUDA_IMAGE}" in b for b in bases)
    user = [rest for word, rest in instructions if word == "USER"][-1]
    assert user.isdigit() and user != "0"
    assert ("ENTRYPOINT", '["voxgate"]') in instructions
    cmd = next(rest for word, rest in instructions if word == "CMD")
    assert cmd == '["serve", "--config", "/etc/voxgate/voxgate.toml"]'
    assert ("COPY", "deploy/voxgate.toml /etc/voxgate/voxgate.toml") in instructions
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    for needed in ("pyproject.toml", "setup.py", "README.md", "engine/", "gateway/", "deploy/voxgate.toml"):
        assert f"!{needed}" in ignored, f".dockerignore leaves {needed} out of the build context"


def test_the_haproxy_config_is_valid():
    run = subprocess.run([_tool("haproxy"), "-c", "-f", str(ROOT / "deploy" / "haproxy.cfg")], capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 0, run.stdout + run.stderr
