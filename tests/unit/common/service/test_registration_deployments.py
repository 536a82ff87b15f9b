"""Gateway replicas in the deployment files: Kubernetes runs two gateways, and the
instances' PDSERVE_GATEWAY names every one of them (a headless Service), as does the
compose service name when `compose.replicas.yaml` lets `--scale gateway=N` publish ports."""
from __future__ import annotations

import pytest

from decode_service.main import build_parser as decode_parser
from tests.unit.deploy.test_manifests import compose_config, k8s_docs, service_env

pytest.importorskip("yaml")


def test_k8s_runs_two_gateways_and_every_instance_registers_with_each_pod(monkeypatch):
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in k8s_docs()}
    gateway = docs[("Deployment", "pdserve-gateway")]["spec"]
    assert gateway["replicas"] == 2
    assert gateway["strategy"]["type"] == "RollingUpdate"  # Recreate would stop both at once
    registry = docs[("Service", "pdserve-gateway-registry")]["spec"]
    assert registry["clusterIP"] == "None"  # headless: its name resolves to every gateway pod
    assert registry["publishNotReadyAddresses"] is True
    assert registry["selector"] == gateway["selector"]["matchLabels"]
    for role in ("prefill", "decode"):
        container = docs[("Deployment", f"pdserve-{role}")]["spec"]["template"]["spec"]["containers"][0]
        value = {e["name"]: e.get("value") for e in container["env"]}["PDSERVE_GATEWAY"]
        assert value == f"pdserve-gateway-registry:{registry['ports'][0]['port']}"
        monkeypatch.setenv("PDSERVE_GATEWAY", value)
        assert decode_parser().parse_args([]).gateway == [value]


def test_compose_replicas_override_publishes_a_port_range_per_replica():
    services = compose_config("compose.yaml", "compose.replicas.yaml")["services"]
    published = {p["target"]: p["published"] for p in services["gateway"]["ports"]}
    assert published == {50051: "50051-50060", 8000: "8000-8009"}  # one host port per replica
    for role in ("prefill", "decode"):
        assert service_env(services[role])["PDSERVE_GATEWAY"] == "gateway:50054"  # every replica's IP
