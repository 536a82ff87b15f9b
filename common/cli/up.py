"""`pdserve up`: a local stack of one gateway (or --gateways G replicas), N prefill and M
decode processes.

Each process runs the very command a deployment runs (`pdserve gateway|prefill|decode`)
with the same settings: every flag `up` does not know itself goes to each command that
defines it (--model and --block-size to all three, --kv-cache-memory to prefill and
decode, --policy to the gateway; a flag none defines is an error), and the environment
(PDSERVE_* variables included) is inherited. Only what differs per process is set by
`up`: --host, --port (0: a free port), --instance-id, --gateway (the gateway's registry
address: its --registry-port, a free port of its own), and --metrics-port 0:
every process serves Prometheus metrics on a free port, named as `metrics=HOST:PORT` in
the READY line it prints (echoed with its name; `ManagedProcess.metrics_address`).
Each prefill and decode process gets `--num-threads`: an equal share of the host's
cores less `--reserved-cpus` (default: 1 from 8 CPUs up, as vLLM's CPU build reserves one
for its API server, where the gateway's and the services' own threads, which wake for every
token, cost an engine at most an eighth of its cores; none below, where a reserved core is
half or a quarter of them: on 2 cores the engine on both streamed fp32 and bf16 tokens with
a 12-25% lower p99 TPOT), decode processes first for a core left over (its pinned CPUs
where a benchmark pins roles), unless the flag is given; a lone decode process that
prefills takes every core for its steps that prefill (`--num-prefill-threads`: it streams
no tokens meanwhile). Where the stack has a prefill pool, each decode process gets
`--single-weight-copy` (it prefills only short prompts itself; `--no-single-weight-copy`
keeps both copies).
Every process gets the same registry token through PDSERVE_REGISTRY_TOKEN (never on a
command line, where `ps` shows it): the environment's, else a fresh random one.

`up` waits until the gateway serves and every instance has registered (ModelInfo
counts), prints the gateway's OpenAI-compatible HTTP address (--http-port; a line of
its own, so the READY line keeps its form) and `PDSERVE_READY gateway=HOST:PORT
prefill=N decode=M`, and stops
everything on Ctrl-C or SIGTERM (SIGTERM to each process, a grace period, then
SIGKILL). A process that exits on its own makes `up` say which and exit 1.

Tests use `LocalStack` directly (a context manager; see tests/integration/test_stack.py).
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time

import grpc

from common.cli.processes import ManagedProcess, ProcessFailed, route_flags
from common.engine.cpus import num_cpus_available
from common.service.flags import EnvDefaultsParser
from gateway.api_keys import API_KEY_ENV, parse_api_keys

REGISTRY_TOKEN_ENV = "PDSERVE_REGISTRY_TOKEN"


def _flag_value(flags: list[str], name: str) -> str | None:
    """The value of `name` in routed flags (["--x", "v"] or ["--x=v"]); the last one wins, as
    argparse reads them."""
    value = None
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
    return value


class LocalStack:
    """A gateway plus N prefill and M decode processes on this host (what `up` runs).

        with LocalStack(2, 2, passthrough=["--kv-cache-memory", "256MiB"]) as stack:
            Client(stack.address).generate("Hello")
            stack.kill("decode-0")           # an instance dying (SIGKILL)
            stack.add_instance("decode")     # one joining: decode-2

    With num_gateways > 1 it runs gateway replicas: every instance registers with every
    gateway (`--gateway A,B`); `gateways[i]` are their processes, `gateway` the first, and
    `kill_gateway(i)` / `restart_gateway(i)` stop one and start it again on its ports.
    """

    def __init__(self, num_prefill: int, num_decode: int, port: int = 0, host: str = "127.0.0.1",
                 passthrough: list[str] | tuple[str, ...] = (), env: dict[str, str] | None = None,
                 log_dir=None, startup_timeout_s: float = 300.0, grace_s: float = 45.0,
                 http_port: int | None = 0, cpu_affinity: dict[str, set[int]] | None = None,
                 role_flags: dict[str, list[str]] | None = None, num_gateways: int = 1,
                 reserved_cpus: int | None = None):
        if num_gateways < 1:
            raise ValueError(f"need at least one gateway; got {num_gateways}")
        if reserved_cpus is not None and reserved_cpus < 0:
            raise ValueError(f"reserved_cpus must be >= 0; got {reserved_cpus}")
        self.reserved_cpus = reserved_cpus  # None: default_reserved_cpus of the CPUs available
        self.num_prefill, self.num_decode, self.num_gateways = num_prefill, num_decode, num_gateways
        # Per role ("gateway", "prefill", "decode"): the CPUs its processes may run on
        # (benchmarks pin roles to cores; torch sizes its thread pool to them, and
        # OMP_NUM_THREADS is set to match), and flags for that role only, after the
        # routed passthrough ones (so they win: argparse keeps a flag's last value).
        self.cpu_affinity = {role: set(cpus) for role, cpus in (cpu_affinity or {}).items()}
        self.role_flags = {role: list(flags) for role, flags in (role_flags or {}).items()}
        for role in [*self.cpu_affinity, *self.role_flags]:
            if role not in ("gateway", "prefill", "decode"):
                raise ValueError(f"unknown role {role!r} in cpu_affinity / role_flags: gateway, prefill or decode")
        self.port, self.host = port, host
        self.http_port = http_port  # the gateway's OpenAI-compatible HTTP port; 0: free, None: off
        self.flags = route_flags(list(passthrough))  # by command
        # One token for the stack: a process that is not ours cannot register with it.
        token = (env or {}).get(REGISTRY_TOKEN_ENV) or os.environ.get(REGISTRY_TOKEN_ENV) or secrets.token_urlsafe(32)
        self.env = {**(env or {}), REGISTRY_TOKEN_ENV: token}
        # The stack's own calls (waiting for registrations) carry the gateway's API key, if any.
        keys = _flag_value(self.flags["gateway"], "--api-key") or self.env.get(API_KEY_ENV) \
            or os.environ.get(API_KEY_ENV)
        self.api_key = next(iter(parse_api_keys(keys)), None) if keys else None
        self.log_dir = log_dir
        self.startup_timeout_s, self.grace_s = startup_timeout_s, grace_s
        self.gateways: list[ManagedProcess] = []
        self._gateway_argv: list[list[str]] = []  # each gateway's flags, its ports fixed once it served
        self.instances: dict[str, ManagedProcess] = {}  # by instance id, e.g. "decode-1"
        self._next_index = {"prefill": 0, "decode": 0}

    @property
    def gateway(self) -> ManagedProcess | None:
        return self.gateways[0] if self.gateways else None

    @property
    def address(self) -> str:
        return self.gateway.address

    @property
    def addresses(self) -> list[str]:
        """Every gateway's public gRPC address, in order."""
        return [g.address for g in self.gateways]

    @property
    def http_address(self) -> str:
        """host:port of the gateway's OpenAI-compatible HTTP API ("" when off)."""
        return self.gateway.http_address

    @property
    def registry_address(self) -> str:
        """host:port where instances register (internal; carries the stack's token);
        with several gateways, a comma list of all of theirs (what --gateway takes)."""
        return ",".join(g.registry_address for g in self.gateways)

    @property
    def registry_token(self) -> str:
        return self.env[REGISTRY_TOKEN_ENV]

    def start(self) -> str:
        """Start everything and wait until all instances registered; return the gateway address."""
        try:
            for index in range(self.num_gateways):
                # Fixed ports (--port, --http-port) go to the first gateway; replicas take free ones.
                port, http_port = (self.port, self.http_port) if index == 0 else (0, 0 if self.http_port is not None
                                                                                   else None)
                self._gateway_argv.append([*self.flags["gateway"], *self.role_flags.get("gateway", ()),
                                           "--host", self.host, "--port", str(port), "--registry-port", "0",
                                           "--metrics-port", "0", "--http-port",
                                           "off" if http_port is None else str(http_port)])
                self.gateways.append(self._start_gateway(index))
            for role, count in (("prefill", self.num_prefill), ("decode", self.num_decode)):
                for _ in range(count):
                    self.add_instance(role, wait=False)
            self.wait_registered(self.num_prefill, self.num_decode)
        except BaseException:
            self.stop()
            raise
        return self.address

    def _start_gateway(self, index: int) -> ManagedProcess:
        name = "gateway" if self.num_gateways == 1 else f"gateway-{index}"  # also its log file's name
        process = ManagedProcess(name, ["gateway", *self._gateway_argv[index]], env=self._role_env("gateway"),
                                 log_dir=self.log_dir, cpus=self.cpu_affinity.get("gateway"))
        try:
            process.wait_ready(self.startup_timeout_s)
        except BaseException:
            process.stop()
            raise
        # A restart must come back where the instances register and clients connect.
        for flag, address in (("--port", process.address), ("--registry-port", process.registry_address),
                              ("--http-port", process.http_address)):
            if address:
                argv = self._gateway_argv[index]
                argv[argv.index(flag) + 1] = address.rsplit(":", 1)[1]
        return process

    def kill_gateway(self, index: int, signum: int = signal.SIGKILL) -> None:
        """Signal one gateway on purpose (it then no longer counts as failed)."""
        self.gateways[index].signal(signum)
        self.gateways[index].wait_or_kill(self.grace_s)

    def restart_gateway(self, index: int) -> ManagedProcess:
        """Start a stopped gateway again on the ports it had; return once it serves (the
        instances register with it again on their own: wait_registered)."""
        self.gateways[index] = self._start_gateway(index)
        return self.gateways[index]

    def add_instance(self, role: str, wait: bool = True) -> ManagedProcess:
        """Start one more prefill or decode process (as `--scale` would); with wait,
        return once it is serving (its PDSERVE_READY line)."""
        instance_id = f"{role}-{self._next_index[role]}"
        self._next_index[role] += 1
        process = ManagedProcess(instance_id, [role, *self._thread_flags(role), *self._weight_flags(role),
                                               *self.flags[role],
                                               *self.role_flags.get(role, ()),
                                               "--host", self.host, "--port", "0",
                                               "--instance-id", instance_id, "--gateway", self.registry_address,
                                               "--metrics-port", "0"],
                                 env=self._role_env(role), log_dir=self.log_dir, cpus=self.cpu_affinity.get(role))
        self.instances[instance_id] = process
        if wait:
            process.wait_ready(self.startup_timeout_s)
        return process

    def _weight_flags(self, role: str) -> list[str]:
        """A decode process beside a prefill pool keeps each weight once (it prefills only
        prompts shorter than --local-prefill-threshold, on the kernel that copy serves); a
        --no-single-weight-copy the user gave comes later and wins."""
        return ["--single-weight-copy"] if role == "decode" and self.num_prefill > 0 else []

    def _thread_flags(self, role: str) -> list[str]:
        """--num-threads for an engine process: its pinned CPUs, else its share of the CPUs
        this process may use (engine_threads; its affinity, no more than its cgroup's CPU
        quota), so prefill and decode do not oversubscribe them. A lone decode process that
        prefills also gets --num-prefill-threads, every CPU: while one of its steps prefills
        it streams no tokens, and nothing else needs the reserved CPUs. Flags the user gave
        come later and win."""
        cpus = self.cpu_affinity.get(role)
        if cpus:
            return ["--num-threads", str(len(cpus))]
        num_cpus = num_cpus_available()
        reserved = default_reserved_cpus(num_cpus) if self.reserved_cpus is None else self.reserved_cpus
        prefill, decode = engine_threads(num_cpus, self.num_prefill, self.num_decode, reserved)
        if role != "decode":
            return ["--num-threads", str(prefill)]
        flags = ["--num-threads", str(decode)]
        if self.num_prefill == 0 and self.num_decode == 1 and num_cpus > decode:
            flags += ["--num-prefill-threads", str(num_cpus)]
        return flags

    def _role_env(self, role: str) -> dict[str, str]:
        cpus = self.cpu_affinity.get(role)
        if not cpus:
            return self.env
        return {**self.env, "OMP_NUM_THREADS": str(len(cpus))}

    def wait_registered(self, num_prefill: int, num_decode: int, timeout_s: float | None = None,
                        gateways: list[int] | None = None) -> None:
        """Wait until each gateway (all, or those indexed by `gateways`) counts at least
        this many live instances per pool."""
        from gateway.client import Client
        deadline = time.monotonic() + (timeout_s or self.startup_timeout_s)
        for index in range(self.num_gateways) if gateways is None else gateways:
            with Client(self.gateways[index].address, api_key=self.api_key) as client:
                while True:
                    self.check_alive()
                    info = client.model_info(timeout=5)
                    if info.num_prefill_instances >= num_prefill and info.num_decode_instances >= num_decode:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"after {timeout_s or self.startup_timeout_s:.0f}s gateway {index} counts "
                                           f"{info.num_prefill_instances}/{num_prefill} prefill and "
                                           f"{info.num_decode_instances}/{num_decode} decode instances")
                    time.sleep(0.2)

    def check_alive(self) -> None:
        """Raise ProcessFailed for a process that exited without being told to."""
        for process in [*self.gateways, *self.instances.values()]:
            if process is not None:
                process.check_alive()

    def kill(self, instance_id: str, signum: int = signal.SIGKILL) -> None:
        """Signal one instance on purpose (it then no longer counts as failed)."""
        self.instances[instance_id].signal(signum)

    def stop(self) -> None:
        """SIGTERM every process, wait up to grace_s for all, then SIGKILL the rest."""
        processes = [*self.instances.values(), *self.gateways]
        for process in processes:
            process.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for process in processes:
            process.wait_or_kill(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> "LocalStack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def default_reserved_cpus(num_cpus: int) -> int:
    """CPUs left out of the engines' share unless --reserved-cpus says: one from 8 CPUs up
    (vLLM's reservation for its API server), none on smaller hosts (see the module's doc)."""
    return 1 if num_cpus >= 8 else 0


def engine_threads(num_cpus: int, num_prefill: int, num_decode: int, reserved_cpus: int) -> tuple[int, int]:
    """(threads of each prefill process, of each decode process): the CPUs less
    reserved_cpus (at least one left) shared equally, the decode processes one more each
    where enough are left over (their steps wait on every core they run on); at least one."""
    num_engines = max(1, num_prefill + num_decode)
    num_engine_cpus = max(1, num_cpus - reserved_cpus)
    share, left_over = divmod(num_engine_cpus, num_engines)
    decode_extra = 1 if num_decode and left_over >= num_decode else 0
    return max(1, share), max(1, share + decode_extra)


def build_parser() -> argparse.ArgumentParser:
    parser = EnvDefaultsParser(
        prog="pdserve up", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other flag (--model, --kv-cache-memory 256MiB, --policy round_robin, ...) goes to "
               "every process as PDSERVE_<FLAG>.")
    parser.add_argument("--prefill", type=int, default=1, help="prefill processes (0: decode prefills)")
    parser.add_argument("--decode", type=int, default=1, help="decode processes")
    parser.add_argument("--gateways", type=int, default=1,
                        help="gateway replicas; every instance registers with each; --port and --http-port "
                             "are the first one's, the others take free ports")
    parser.add_argument("--host", default="127.0.0.1", help="interface every process listens on")
    parser.add_argument("--port", type=int, default=50051, help="the gateway's port (0: a free one)")
    parser.add_argument("--http-port", default=None,
                        help="the gateway's OpenAI-compatible HTTP port (0: a free one; -1 or 'off': none); "
                             "default 8000, or a free one when --port is 0")
    parser.add_argument("--reserved-cpus", type=int, default=None,
                        help="cores left out of the engines' --num-threads share for the gateway and the "
                             "services' own threads (vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU); default: 1 on hosts "
                             "of 8 CPUs or more, else 0 (the engines take every core)")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="seconds to wait for every instance to register")
    parser.add_argument("--grace", type=float, default=45.0,
                        help="seconds between SIGTERM and SIGKILL when stopping; more than the processes' "
                             "own --grace-period / --drain-timeout, so requests in flight can finish")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, passthrough = build_parser().parse_known_args(argv)
    if args.decode < 1 or args.prefill < 0 or args.gateways < 1 or (args.reserved_cpus or 0) < 0:
        print("pdserve up: need --decode >= 1, --prefill >= 0, --gateways >= 1 and --reserved-cpus >= 0",
              file=sys.stderr)
        return 2
    # SIGTERM stops the stack like Ctrl-C does, also while it is still starting.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        from gateway.openai_api.server import default_http_port, parse_http_port
        http_port = parse_http_port(args.http_port) if args.http_port is not None else default_http_port(args.port)
        stack = LocalStack(args.prefill, args.decode, port=args.port, host=args.host, http_port=http_port,
                           passthrough=passthrough, startup_timeout_s=args.startup_timeout, grace_s=args.grace,
                           num_gateways=args.gateways, reserved_cpus=args.reserved_cpus)
    except ValueError as e:  # a flag no command takes, a bad --http-port
        print(f"pdserve up: error: {e}", file=sys.stderr)
        return 2
    try:
        stack.start()
        if stack.http_address:
            scheme = "https" if _flag_value(stack.flags["gateway"], "--ssl-certfile") else "http"
            print(f"pdserve up: OpenAI-compatible HTTP API at {scheme}://{stack.http_address}/v1", flush=True)
        if args.gateways > 1:
            print(f"pdserve up: gateway replicas at {', '.join(stack.addresses)}", flush=True)
        print(f"PDSERVE_READY gateway={stack.address} prefill={args.prefill} decode={args.decode}",
              flush=True)
        while True:
            stack.check_alive()
            time.sleep(0.5)
    except (ProcessFailed, TimeoutError, grpc.RpcError) as e:
        print(f"pdserve up: {e}; stopping the stack", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM
        return 0
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
