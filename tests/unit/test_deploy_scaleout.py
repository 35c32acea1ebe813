"""Scale-out deployment files (issue 27): the replicated Deployment and the gateways in front of
it (deploy/kubernetes/replicas, sglang-gateway, inference-gateway) against the bundled
Kubernetes schemas, the InferencePool (a CRD those schemas do not know) against the fields of
its v1 API, and the `replicas` profile of docker-compose.yml. The commands the pods and
containers run are parsed by the real parsers (pytgi-launcher's, sglang-router's), and the
draining timeline must hold: a replica reports not-ready for longer than the readiness probe
and the gateway take to notice, and is given more than its drain to exit."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from sglang_router.launch_router import parse_router_args

from pytgi_launcher.cli import parse_settings as parse_launcher
from tests.unit.test_deploy import K8S_VERSIONS, ROOT, exported_metric_names

K8S = ROOT / "deploy" / "kubernetes"
FOLDERS = ["replicas", "sglang-gateway", "inference-gateway"]
# The image's environment (Dockerfile: ENV PORT=80) that the launcher reads.
IMAGE_ENV = {"PORT": "80"}
# InferencePool v1 (inference.networking.k8s.io): the fields its CRD defines under spec.
POOL_SPEC = {"selector", "targetPorts", "endpointPickerRef", "appProtocol"}
POOL_PICKER = {"name", "port", "failureMode", "group", "kind"}


def docs_in(folder: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted((K8S / folder).glob("*.yaml")):
        if path.name != "kustomization.yaml":
            out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def find(folder: str, kind: str, name: str) -> dict[str, Any]:
    for doc in docs_in(folder):
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name} in {folder}")


def container(doc: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = doc["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def pod_labels(doc: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = doc["spec"]["template"]["metadata"]["labels"]
    return labels


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def replica() -> tuple[dict[str, Any], dict[str, Any], Any]:
    dep = find("replicas", "Deployment", "pytgi-replica")
    c = container(dep)
    return dep, c, parse_launcher(c["args"], environ=IMAGE_ENV)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(version: str) -> None:
    kinds = set()
    for folder in FOLDERS:
        for doc in docs_in(folder):
            kinds.add(doc["kind"])
            if doc["kind"] != "InferencePool":  # a CRD: test_inference_pool checks it
                kubernetes_validate.validate(doc, version, strict=True)
    assert kinds >= {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding",
                     "InferencePool"}


def test_each_kustomization_lists_its_folder() -> None:
    for folder in FOLDERS:
        listed = yaml.safe_load((K8S / folder / "kustomization.yaml").read_text())["resources"]
        files = {r for r in listed if not r.startswith("..")}
        assert files == {p.name for p in (K8S / folder).glob("*.yaml")} - {"kustomization.yaml"}
        for base in set(listed) - files:  # kustomize takes folders, not files, from outside
            assert (K8S / folder / base / "kustomization.yaml").is_file(), (folder, base)
    for gateway in ("sglang-gateway", "inference-gateway"):
        assert "../replicas" in (K8S / gateway / "kustomization.yaml").read_text()


def test_replicas_drain_before_they_stop() -> None:
    dep, c, settings = replica()
    assert settings.port == 80 and c["ports"][0]["containerPort"] == 80
    drain = settings.drain_grace_seconds
    ready = c["readinessProbe"]
    assert ready["httpGet"]["path"] == "/health"
    # Kubernetes takes the pod out of its endpoints within the grace, while it still serves.
    assert ready["periodSeconds"] * ready.get("failureThreshold", 3) < drain
    # Liveness must not follow /health, which is 503 on purpose while draining.
    assert "httpGet" not in c["livenessProbe"]
    spec = dep["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] > drain + settings.graceful_termination_timeout
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_sglang_gateway_discovers_the_replicas_and_notices_a_drain_in_time() -> None:
    dep, c, settings = replica()
    gateway = find("sglang-gateway", "Deployment", "pytgi-gateway")
    g = container(gateway)
    args = parse_router_args([a.replace("$(POD_NAMESPACE)", "ns") for a in g["args"]])
    assert args.service_discovery and args.service_discovery_namespace == "ns"
    assert args.selector == pod_labels(dep)
    assert args.service_discovery_port == c["ports"][0]["containerPort"]
    assert (args.health_check_interval_secs * args.health_failure_threshold
            + args.health_check_timeout_secs) < settings.drain_grace_seconds
    assert {"name": "POD_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in g["env"]
    # It may read the pods it routes to, as the ServiceAccount it runs as.
    account = gateway["spec"]["template"]["spec"]["serviceAccountName"]
    role = find("sglang-gateway", "Role", account)
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]} in \
        role["rules"]
    binding = find("sglang-gateway", "RoleBinding", account)
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    svc = find("sglang-gateway", "Service", "pytgi")
    assert svc["spec"]["selector"] == pod_labels(gateway)
    assert {p["name"]: p["containerPort"] for p in g["ports"]}["http"] == args.port


def test_inference_pool_selects_the_replicas_and_its_picker_reads_pytgi_metrics() -> None:
    dep, c, _ = replica()
    pool = find("inference-gateway", "InferencePool", "pytgi")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= POOL_SPEC and {"selector", "targetPorts"} <= set(spec)
    assert set(spec["selector"]) == {"matchLabels"}
    assert spec["selector"]["matchLabels"] == pod_labels(dep)
    assert spec["targetPorts"] == [{"number": c["ports"][0]["containerPort"]}]
    picker = spec["endpointPickerRef"]
    assert set(picker) <= POOL_PICKER and picker.get("failureMode") in (None, "FailOpen",
                                                                        "FailClose")
    svc = find("inference-gateway", "Service", picker["name"])
    port = next(p for p in svc["spec"]["ports"] if p["port"] == picker["port"]["number"])
    epp = find("inference-gateway", "Deployment", picker["name"])
    e = container(epp)
    assert {p["name"]: p["containerPort"] for p in e["ports"]}[port["targetPort"]] == \
        int(flag(e["args"], "--grpc-port"))
    assert svc["spec"]["selector"] == pod_labels(epp)
    assert flag(e["args"], "--pool-name") == pool["metadata"]["name"]
    exported = exported_metric_names()
    for name in ("--total-queued-requests-metric", "--kv-cache-usage-percentage-metric",
                 "--cache-info-metric"):
        assert flag(e["args"], name) in exported, name
    # vLLM's LoRA info metric (name and labels), which the picker reads by that name.
    assert flag(e["args"], "--lora-info-metric") == "vllm:lora_requests_info"
    role = find("inference-gateway", "Role", epp["spec"]["template"]["spec"]["serviceAccountName"])
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"]}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted


def test_compose_replicas_profile() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    profiled = {name for name, s in services.items() if "replicas" in s.get("profiles", [])}
    assert profiled == {"replica-1", "replica-2", "gateway"}
    gateway = services["gateway"]
    args = parse_router_args(gateway["command"])
    replicas = sorted(profiled - {"gateway"})
    assert args.worker_urls == [f"http://{name}:80" for name in replicas]
    assert set(gateway["depends_on"]) == set(replicas)
    gpus = []
    for name in replicas:
        s = services[name]
        settings = parse_launcher(s["command"], environ=IMAGE_ENV)
        assert settings.port == 80
        grace = settings.drain_grace_seconds
        assert (args.health_check_interval_secs * args.health_failure_threshold
                + args.health_check_timeout_secs) < grace
        stop = int(re.fullmatch(r"(\d+)s", s["stop_grace_period"]).group(1))  # type: ignore[union-attr]
        assert stop > grace + settings.graceful_termination_timeout
        gpus += s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    assert len(set(gpus)) == len(gpus)  # one GPU each
    dockerfile = ROOT / gateway["build"] / "Dockerfile"
    pinned = re.search(r"sglang-router==([\d.]+)", dockerfile.read_text())
    assert pinned is not None
    # The release the integration tests run: at least pyproject's lower bound.
    bound = re.search(r'"sglang-router>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert bound is not None
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert as_tuple(pinned.group(1)) >= as_tuple(bound.group(1))
    assert Path(ROOT / "deploy/gateway/Dockerfile").read_text().count("ENTRYPOINT") == 1
