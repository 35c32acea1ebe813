"""Deployment files: Kubernetes manifests against the bundled Kubernetes schemas (offline),
docker-compose wiring, and every metric the dashboards query being one the router exports."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pytgi_router.cli import parse_settings as parse_router
from pytgi_router.metrics import Metrics
from pytgi_shard.service.cli import build_parser as shard_parser
from pytgi_shard.service.cli import settings_from_args as shard_settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
# 1.28: first release that labels StatefulSet pods with apps.kubernetes.io/pod-index.
K8S_VERSIONS = ["1.28.0", "1.33.0"]
METRIC = re.compile(r"\b(?:tgi|pytgi)_[a-z_]+\b")


def manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def find(kind: str, name: str) -> dict[str, Any]:
    for doc in manifests():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name}")


def container(doc: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = doc["spec"]["template"]["spec"]["containers"]
    return containers[0]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def exec_argv(script: str, values: dict[str, str]) -> list[str]:
    """The argv after `exec` in a container's shell script, its variables substituted."""
    command = script.split("exec ", 1)[1]
    command = re.sub(r"\$\{MODEL_ID:\+[^}]*\}", "", command)
    for name, value in values.items():
        command = command.replace(f"${{{name}}}", value).replace(f"${name}", value)
    return shlex.split(command)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(version: str) -> None:
    docs = manifests()
    assert {d["kind"] for d in docs} >= {"StatefulSet", "Deployment", "Service", "ConfigMap"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_schema_validation_catches_mistakes() -> None:
    doc = find("StatefulSet", "pytgi-shard")
    container(doc)["unknownField"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


def test_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(listed) == present


def test_shards_are_a_statefulset_with_a_pod_per_rank() -> None:
    sts = find("StatefulSet", "pytgi-shard")
    svc = find("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    c = container(sts)
    env = env_of(c)
    index = "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["RANK"] == {"fieldRef": {"fieldPath": index}}
    assert int(env["WORLD_SIZE"]) == sts["spec"]["replicas"]
    assert env["MASTER_ADDR"] == f"{sts['metadata']['name']}-0.{svc['metadata']['name']}"
    # Readiness follows the engine (NOT_SERVING until the router's Warmup); start-up and liveness
    # must not, or an un-warmed shard waiting for its router would be killed.
    assert c["readinessProbe"]["grpc"]["port"] == 50051
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["tcpSocket"]["port"] == "grpc"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "1"
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    # The shard's own parser accepts the command the pod runs, and it listens on TCP.
    argv = exec_argv(c["args"][0], {"MODEL_PATH": "/data/m", "POD_NAME": "pytgi-shard-1"})
    assert argv[0] == "pytgi-shard"
    args = shard_parser().parse_args(argv[1:])
    assert args.command == "serve" and args.port == 50051
    assert args.advertise_address == "pytgi-shard-1.pytgi-shard:50051"
    assert "pytgi-shard download-weights" in c["args"][0]


def test_router_deployment_points_at_shard_zero() -> None:
    dep = find("Deployment", "pytgi-router")
    c = container(dep)
    argv = exec_argv(c["args"][0], {"TOKENIZER": "/tmp/tok"})
    assert argv[0] == "pytgi-router"
    settings = parse_router(argv[1:], environ={})
    assert settings.master_shard_address == "pytgi-shard-0.pytgi-shard:50051"
    assert settings.port == 80
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    svc = find("Service", "pytgi")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())
    assert "--metadata-only" in c["args"][0]


def test_compose_wires_gpu_prometheus_grafana_jaeger() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    pytgi = services["pytgi"]
    assert pytgi["shm_size"] == "1g"
    device = pytgi["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert pytgi["environment"]["OTLP_ENDPOINT"] == "http://jaeger:4317"
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    for service in ("prometheus", "grafana"):
        for volume in services[service]["volumes"]:
            host = volume.split(":")[0]
            assert (ROOT / host).exists(), volume
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    job = prometheus["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["pytgi:80"]
    ds = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    assert ds["url"] == "http://prometheus:9090"
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/pytgi.json").read_text())
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {ds["uid"]}


def exported_metric_names() -> set[str]:
    names = set()
    for family in Metrics().registry.collect():
        if family.type == "histogram":
            names |= {f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
        elif family.type == "counter":
            names.add(f"{family.name}_total")
        else:
            names.add(family.name)
    return names


def test_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/pytgi.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in METRIC.findall(e)}
    exported = exported_metric_names()
    assert used - exported == set(), f"not exported by the router: {used - exported}"
    # What the issue asks the dashboard to show.
    for needed in ("tgi_queue_size", "tgi_batch_current_size", "tgi_request_duration_bucket",
                   "tgi_request_generated_tokens_sum", "pytgi_kv_blocks_free"):
        assert needed in used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    instructions = [line.split(None, 1) for line in text.splitlines()
                    if line.strip() and not line.startswith((" ", "#"))]
    by = {}
    for parts in instructions:
        by.setdefault(parts[0], []).append(parts[1] if len(parts) > 1 else "")
    assert by["FROM"][0].startswith("nvidia/cuda:") and "runtime" in by["FROM"][0]
    assert by["ENTRYPOINT"] == ['["pytgi-launcher"]']
    assert "/data" in by["VOLUME"]
    for copied in by["COPY"]:
        for src in copied.split()[:-1]:
            assert (ROOT / src).exists(), src
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_make_run_serves_the_demo_on_8080() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^PORT \?= 8080$", makefile, re.M)
    recipe = makefile.split("\nrun:", 1)[1].split("\n\n", 1)[0]
    assert "pytgi-launcher --port $(PORT)" in recipe and "--model-id" not in recipe
    # A newcomer's first server compiles its small decode steps (README: --cpu-graphs).
    assert "--cpu-graphs $(CPU_GRAPHS)" in recipe
    assert re.search(r"^CPU_GRAPHS \?= 1,2,4,8,16,32,64$", makefile, re.M)


def pod_labels(doc: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = doc["spec"]["template"]["metadata"]["labels"]
    return labels


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_only_the_router_and_other_shards_reach_a_shard() -> None:
    """Issue 11 item 10: a NetworkPolicy on the shard pods admits the router's pods on the gRPC
    port and the other shards (rendezvous, NCCL's ephemeral ports), and nothing else."""
    policy = find("NetworkPolicy", "pytgi-shard")
    shard, router = pod_labels(find("StatefulSet", "pytgi-shard")), pod_labels(
        find("Deployment", "pytgi-router"))
    spec = policy["spec"]
    assert selects(spec["podSelector"], shard) and not selects(spec["podSelector"], router)
    assert spec["policyTypes"] == ["Ingress"]
    allowed = []
    for rule in spec["ingress"]:
        # Pods of this namespace only: no namespaceSelector, no ipBlock, never an open `from`.
        assert rule["from"] and all(set(peer) == {"podSelector"} for peer in rule["from"])
        for peer in rule["from"]:
            who = ("router" if selects(peer["podSelector"], router) else
                   "shard" if selects(peer["podSelector"], shard) else "other")
            allowed.append((who, [p["port"] for p in rule.get("ports", [])]))
    assert sorted(allowed) == [("router", [50051]), ("shard", [])]
    assert "network-policy.yaml" in (K8S / "kustomization.yaml").read_text()


def test_shards_and_router_share_the_optional_shard_token() -> None:
    """Both read SHARD_TOKEN from the same optional Secret key; the shard's and the router's own
    parsers take it from the environment (never from argv, which every user can read)."""
    shard_c = container(find("StatefulSet", "pytgi-shard"))
    router_c = container(find("Deployment", "pytgi-router"))
    refs = [env_of(c)["SHARD_TOKEN"]["secretKeyRef"] for c in (shard_c, router_c)]
    assert refs[0] == refs[1] == {"name": "pytgi-shard-token", "key": "SHARD_TOKEN",
                                  "optional": True}
    assert "--shard-token" not in shard_c["args"][0] + router_c["args"][0]
    argv = exec_argv(shard_c["args"][0], {"MODEL_PATH": "/data/m", "POD_NAME": "pytgi-shard-1"})
    shard = shard_settings(shard_parser().parse_args(argv[1:]), {"SHARD_TOKEN": "t0k"})
    assert shard.shard_token == "t0k"
    # Over TCP reflection stays off unless the command asks for it.
    assert not shard.reflection_enabled
    router_argv = exec_argv(router_c["args"][0], {"TOKENIZER": "/tmp/tok"})
    assert parse_router(router_argv[1:], environ={"SHARD_TOKEN": "t0k"}).shard_token == "t0k"
