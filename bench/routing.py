"""Prefix-aware placement through the real stack (issue 5): `pdserve bench routing`.

    pdserve bench routing --json docs/bench/prefix_routing.json
    pdserve bench routing --num-requests 16 --policies round_robin,prefix_aware  # smoke
    pdserve bench routing --policies prefix_aware --num-gateways 2  # gateway replicas

For each placement policy (round_robin, least_loaded, prefix_aware) it starts a real
stack, `LocalStack(2 prefill, 1 decode, --policy P)`, sends the same seeded workload
through the gateway's GenerateStream, and reads the prefill instances' prefix-cache
counters (the Stats RPC) before and after:

    hit rate = sum(prefix_cache_hit_tokens) / sum(prefix_cache_queried_tokens)

over both prefill instances (deltas, so the warm-up does not count).

Colocated (--colocated): no prefill pool; `LocalStack(0 prefill, 2 decode)`, each decode
instance prefilling every prompt itself with a pool of --prefill-kv-blocks blocks, placed by
the policy's choice for a local prefill (prefix_aware: the decode instances' own KV events,
weighed against the KV their running requests hold); the hit rates are the decode instances'.

Gateway replicas (--num-gateways N): the stack runs N gateways, every instance registered
with each, and the client sends request i to gateway i mod N (as a balancer in front of
them would), so each gateway places while the others dispatch too. Compare the hit rate
with --num-gateways 1 on the same seed.

Workload (bench.serve.datasets.system_prompt_requests, token ids): 8 tenants,
each with a 512-token system prompt (32 whole blocks), plus a unique user part of
64-128 tokens, 8-16 output tokens (prefill dominates); tenants in rounds (each tenant
once per round: steady per-tenant rates) or drawn at random; --num-requests sent
closed-loop with --max-concurrency in flight. The default runs every policy twice, with
1 and with 2 requests in flight, each on fresh stacks: with 1 the prefill instances
are idle whenever a request arrives, with 2 one of them is usually busy with the other
request, so load-aware policies weigh its queue against the cached prefix.

Sizing: each prefill pool holds --prefill-kv-blocks blocks (default 192, six of the
eight 32-block system prompts): one instance cannot cache every tenant, both together
can (four each, with room for the requests in flight and their unique parts), so
placement decides the hit rate. The decode instance gets its own, larger pool (--decode-kv-memory) and
`--local-prefill-threshold 0`, so it never prefills locally and every prompt goes to
the prefill pool (checked: the prefill instances' finished-request counts must add up
to the requests sent).

Oracle: no real-stack arm. The exact request sequence (same prompts, the measured
send times of the prefix_aware arm), the same cache capacity and the measured prefill
rate are replayed through bench.placement_sim, whose oracle knows every instance's
true cache (including what queued requests will have cached) and picks the longest
cached prefix, breaking ties by load: greedy, so not an upper bound (when no instance
holds a prompt's prefix it, too, picks the least loaded). The replay runs the real
policy code for the other policies too, so simulated and measured hit rates can be
compared. "ideal" is the bound no policy beats on this workload: every tenant's system
prompt computed once.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import grpc
import numpy as np

from bench.serve.client import GrpcGenerateBackend, run_benchmark
from bench.serve.datasets import TENANT_ORDERS, BenchRequest, Vocabulary, parse_length_range, system_prompt_requests
from bench.serve.metrics import compute_metrics
from common.service.flags import EnvDefaultsParser
from gateway.routing.policies import POLICIES

SIM_POLICIES = ("round_robin", "least_loaded", "prefix_aware", "oracle")


@dataclass(frozen=True)
class RoutingConfig:
    policies: tuple[str, ...] = POLICIES
    num_requests: int = 64
    concurrencies: tuple[int, ...] = (1, 2)  # requests in flight; one set of arms each
    num_tenants: int = 8
    system_prompt_len: int = 512
    user_len_range: tuple[int, int] = (64, 128)
    output_len_range: tuple[int, int] = (8, 16)
    tenant_order: str = "rounds"
    prefill_kv_blocks: int = 192
    decode_kv_memory: str = "512MiB"
    block_size: int = 16
    seed: int = 0
    heartbeat_interval_s: float = 1.0  # the gateway's default; the simulation's replay uses it too
    num_gateways: int = 1  # gateway replicas; the client sends request i to gateway i mod N
    # No prefill pool: 2 decode instances that prefill every prompt themselves, each with the
    # prefill instances' small pool, placed by their own KV events (colocated serving)
    colocated: bool = False

    @property
    def cache_role(self) -> str:
        """The role whose prefix caches the placement fills."""
        return "decode" if self.colocated else "prefill"

    def check(self) -> None:
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown or not self.policies:
            raise ValueError(f"--policies: choose from {', '.join(POLICIES)}; got {','.join(self.policies)}")
        if self.num_requests < 1 or not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError("--num-requests and every --max-concurrency must be >= 1")
        if self.num_gateways < 1:
            raise ValueError("--num-gateways must be >= 1")
        if self.tenant_order not in TENANT_ORDERS:
            raise ValueError(f"--tenant-order: choose from {', '.join(TENANT_ORDERS)}")
        longest = self.system_prompt_len + self.user_len_range[1] + self.output_len_range[1]
        if self.prefill_kv_blocks * self.block_size < longest:
            raise ValueError(f"--prefill-kv-blocks {self.prefill_kv_blocks} holds fewer than the "
                             f"{longest} tokens of the longest request")

    def stack_flags(self, policy: str, prefill_kv_bytes: int) -> tuple[list[str], dict[str, list[str]]]:
        """(passthrough, role_flags) for LocalStack."""
        if self.colocated:
            return ["--policy", policy, "--block-size", str(self.block_size), "--kv-cache-memory",
                    str(prefill_kv_bytes), "--log-level", "WARNING"], {}
        passthrough = ["--policy", policy, "--block-size", str(self.block_size),
                       "--kv-cache-memory", self.decode_kv_memory, "--local-prefill-threshold", "0",
                       "--log-level", "WARNING"]
        return passthrough, {"prefill": ["--kv-cache-memory", str(prefill_kv_bytes)]}


def kv_bytes_per_block(block_size: int, model: str | None = None, dtype_size: int | None = None) -> int:
    """Bytes one KV block takes in every layer, from the model's config; by default in the
    dtype the stack's engines pick (`--dtype auto` on this CPU: bf16 where it is native)."""
    import torch

    from common.engine.config import ModelConfig
    from common.engine.device import select_dtype
    from common.engine.model_files import load_hf_config, resolve_model
    config = ModelConfig.from_hf_config(load_hf_config(resolve_model(model)))
    if dtype_size is None:
        dtype_size = select_dtype("auto", torch.device("cpu")).itemsize
    return config.kv_bytes_per_token(dtype_size) * block_size


def ideal_hit_rate(requests: list[BenchRequest], system_prompt_len: int, block_size: int) -> float:
    """Every tenant's system prompt computed exactly once, all later ones served from cache
    (whole blocks only: a prefix cache hits in blocks)."""
    cacheable = system_prompt_len // block_size * block_size
    seen: set[str] = set()
    hits = 0
    for request in requests:
        hits += cacheable if request.kind in seen else 0
        seen.add(request.kind)
    return hits / sum(r.prompt_len for r in requests)


# ---- the real stack -------------------------------------------------------------------

def instance_stats(address: str, role: str):
    from protos.pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
    stub_class = prefill_pb2_grpc.PrefillServiceStub if role == "prefill" else decode_pb2_grpc.DecodeServiceStub
    with grpc.insecure_channel(address) as channel:
        return stub_class(channel).Stats(common_pb2.StatsRequest(), timeout=10)


def wait_idle(stack, timeout_s: float = 120.0) -> None:
    """Until every instance runs and queues nothing (KV in flight included)."""
    deadline = time.monotonic() + timeout_s
    for name, process in stack.instances.items():
        while True:
            load = instance_stats(process.address, name.split("-")[0]).load
            if load.num_running_requests == 0 and load.num_waiting_requests == 0:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} still busy after {timeout_s:.0f}s: {load}")
            time.sleep(0.1)


def cache_counters(stack, role: str) -> dict[str, dict[str, int]]:
    """The prefix-cache counters of the stack's instances of `role`."""
    counters = {}
    for name, process in sorted(stack.instances.items()):
        if name.startswith(role):
            stats = instance_stats(process.address, role)
            counters[name] = {"queried_tokens": stats.prefix_cache_queried_tokens,
                              "hit_tokens": stats.prefix_cache_hit_tokens,
                              "finished_requests": stats.num_finished_requests,
                              "total_blocks": stats.load.num_total_blocks}
    return counters


class PlacementRecordingBackend(GrpcGenerateBackend):
    """The bench client's gRPC backend, also noting which instance of placed_role served each
    request; with several gateway addresses it sends each request to the next gateway in turn."""

    def __init__(self, addresses: list[str], placed_role: str = "prefill", **kwargs):
        super().__init__(addresses[0], **kwargs)
        self.placed_field = f"{placed_role}_instance_id"  # the response field naming the instance to note
        self.addresses = list(addresses)
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list = []
        self._sent = itertools.count()
        self.instance_by_request: dict[int, str] = {}  # id(BenchRequest) -> the placed_role instance
        self.gateway_by_request: dict[int, int] = {}  # id(BenchRequest) -> gateway index

    async def open(self) -> None:
        from protos.pdserve.v1 import generate_pb2_grpc
        self._channels = [grpc.aio.insecure_channel(a) for a in self.addresses]
        self._stubs = [generate_pb2_grpc.GenerateServiceStub(c) for c in self._channels]
        self._stub = self._stubs[0]  # ModelInfo and the like

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        self._channels, self._stubs = [], []

    def _stub_for(self, request: BenchRequest):
        gateway = next(self._sent) % len(self._stubs)
        self.gateway_by_request[id(request)] = gateway
        return self._stubs[gateway]

    async def stream(self, request: BenchRequest):
        async for arrival, response in self.stream_messages(request):
            placed = getattr(response, self.placed_field)
            if placed:
                self.instance_by_request[id(request)] = placed
            yield arrival, len(response.token_ids)


async def _drive(addresses: list[str], requests: list[BenchRequest], warmup: list[BenchRequest],
                 max_concurrency: int, seed: int, after_warmup, placed_role: str
                 ) -> tuple[list, float, list[str], list[int]]:
    async with PlacementRecordingBackend(addresses, placed_role, request_id_prefix="routing") as backend:
        warm, _ = await run_benchmark(backend, warmup, float("inf"))  # both at once: one per instance
        if not all(o.success for o in warm):
            raise RuntimeError(f"warm-up failed: {[o.error for o in warm]}")
        await asyncio.to_thread(after_warmup)
        outcomes, duration = await run_benchmark(backend, requests, float("inf"), max_concurrency=max_concurrency,
                                                 seed=seed, progress=True)
        placed = [backend.instance_by_request.get(id(r), "") for r in requests]
        gateways = [backend.gateway_by_request.get(id(r), -1) for r in requests]
    return outcomes, duration, placed, gateways


def run_policy(policy: str, concurrency: int, cfg: RoutingConfig, requests: list[BenchRequest],
               warmup: list[BenchRequest], prefill_kv_bytes: int, log_dir: str) -> dict:
    from common.cli.up import LocalStack
    passthrough, role_flags = cfg.stack_flags(policy, prefill_kv_bytes)
    num_prefill, num_decode = (0, 2) if cfg.colocated else (2, 1)
    print(f"\n== {policy}: starting LocalStack({num_prefill} prefill, {num_decode} decode, {cfg.num_gateways} "
          f"gateway(s)) {' '.join(passthrough)} {' '.join(role_flags.get('prefill', []))}", flush=True)
    started = time.monotonic()
    with LocalStack(num_prefill, num_decode, passthrough=passthrough, role_flags=role_flags, log_dir=log_dir,
                    num_gateways=cfg.num_gateways) as stack:
        print(f"   stack up in {time.monotonic() - started:.0f}s; warm-up, then {len(requests)} requests, "
              f"{concurrency} in flight", flush=True)
        before: dict = {}

        def snapshot_before() -> None:
            wait_idle(stack)
            time.sleep(1.5 * cfg.heartbeat_interval_s)  # the gateway's load estimate forgets the warm-up
            before.update(cache_counters(stack, cfg.cache_role))

        outcomes, duration, placed, gateways = asyncio.run(_drive(stack.addresses, requests, warmup, concurrency,
                                                                  cfg.seed, snapshot_before, cfg.cache_role))
        wait_idle(stack)
        after = cache_counters(stack, cfg.cache_role)
    per_instance = {name: {key: after[name][key] - before[name][key] for key in
                           ("queried_tokens", "hit_tokens", "finished_requests")} | {
                        "total_blocks": after[name]["total_blocks"]} for name in after}
    queried = sum(v["queried_tokens"] for v in per_instance.values())
    hits = sum(v["hit_tokens"] for v in per_instance.values())
    metrics = compute_metrics(outcomes, duration, percentiles=[50, 90, 99])
    tenants_by_instance: dict[str, list[str]] = {}
    for request, instance in zip(requests, placed):
        tenants = tenants_by_instance.setdefault(instance or "?", [])
        if request.kind not in tenants:
            tenants.append(request.kind)
    result = {
        "policy": policy, "hit_rate": hits / queried if queried else None,
        "queried_tokens": queried, "hit_tokens": hits, "per_instance": per_instance,
        "prefilled_remotely": sum(v["finished_requests"] for v in per_instance.values()),
        "completed": metrics["completed"], "failed": metrics["failed"], "duration_s": duration,
        "mean_ttft_ms": metrics["mean_ttft_ms"], "median_ttft_ms": metrics["median_ttft_ms"],
        "p90_ttft_ms": metrics["p90_ttft_ms"], "p99_ttft_ms": metrics["p99_ttft_ms"],
        "mean_e2el_ms": metrics["mean_e2el_ms"], "request_throughput": metrics["request_throughput"],
        "tenants_by_instance": {k: sorted(v, key=lambda t: int(t.split("-")[1])) for k, v in
                                sorted(tenants_by_instance.items())},
        "prefill_instance_ids": placed, "num_gateways": cfg.num_gateways,
        "requests_per_gateway": [gateways.count(g) for g in range(cfg.num_gateways)],
        "start_times": metrics["start_times"], "ttfts": metrics["ttfts"],
        "errors": [e for e in metrics["errors"] if e],
    }
    hit_rate = "-" if result["hit_rate"] is None else f"{result['hit_rate']:.3f}"
    print(f"   {policy}, {concurrency} in flight: hit rate {hit_rate} ({hits}/{queried} tokens), "
          f"mean TTFT {result['mean_ttft_ms']:.0f} ms, {result['completed']} ok / {result['failed']} failed in "
          f"{duration:.0f}s; prefilled by the {cfg.cache_role} pool {result['prefilled_remotely']}/{len(requests)}; "
          f"tenants by instance {result['tenants_by_instance']}", flush=True)
    return result


# ---- the simulation replay ------------------------------------------------------------

def replay_in_simulator(requests: list[BenchRequest], send_times_s: list[float], cfg: RoutingConfig,
                        cache_blocks: int, prefill_tokens_per_s: float) -> dict[str, float]:
    """Hit rate of each simulated policy on this exact request sequence and cache size."""
    from bench.placement_sim import SimConfig, SimRequest, simulate
    from common.engine.block_hash import compute_block_hashes
    sim_cfg = SimConfig(num_tenants=cfg.num_tenants, system_prompt_tokens=cfg.system_prompt_len,
                        block_size=cfg.block_size, num_prefill=2, cache_blocks=cache_blocks,
                        num_requests=len(requests), prefill_tokens_per_s=prefill_tokens_per_s,
                        heartbeat_interval_s=cfg.heartbeat_interval_s, seed=cfg.seed)
    arrivals = np.maximum.accumulate(np.asarray(send_times_s, dtype=float))  # FIFO needs them ordered
    sim_requests = [SimRequest(float(t), int(r.kind.split("-")[1]), r.prompt_len,
                               compute_block_hashes(r.prompt, cfg.block_size))
                    for r, t in zip(requests, arrivals)]
    return {policy: simulate(policy, sim_cfg, sim_requests).hit_rate for policy in SIM_POLICIES}


# ---- the whole benchmark --------------------------------------------------------------

def model_vocabulary(model: str | None) -> Vocabulary:
    """The model's vocabulary and its special ids (which prompts avoid), no stack needed."""
    from common.engine.model_files import resolve_model
    from common.text.prompt_tokenizer import load_prompt_tokenizer
    tokenizer = load_prompt_tokenizer(resolve_model(model))
    special = (set(getattr(tokenizer, "all_special_ids", ())) | set(tokenizer.eos_token_ids)
               | {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special})
    return Vocabulary(tokenizer.vocab_size, frozenset(special))


def run(cfg: RoutingConfig, log_dir: str) -> dict:
    cfg.check()
    vocab = model_vocabulary(None)
    rng = np.random.default_rng(cfg.seed)
    requests = system_prompt_requests(cfg.num_requests, vocab, rng, cfg.num_tenants, cfg.system_prompt_len,
                                      cfg.user_len_range, cfg.output_len_range, cfg.tenant_order)
    # Two short unrelated prompts sent at once: every policy puts one on each prefill
    # instance, so both have run the model once before anything is measured.
    warmup = [BenchRequest(ids, len(ids), 2, "warmup") for ids in
              (rng.choice(vocab.ordinary_ids(), size=48).tolist() for _ in range(2))]
    prefill_kv_bytes = cfg.prefill_kv_blocks * kv_bytes_per_block(cfg.block_size)
    ideal = ideal_hit_rate(requests, cfg.system_prompt_len, cfg.block_size)
    by_concurrency = {}
    for concurrency in cfg.concurrencies:
        results = {policy: run_policy(policy, concurrency, cfg, requests, warmup, prefill_kv_bytes, log_dir)
                   for policy in cfg.policies}
        by_concurrency[str(concurrency)] = summarize_arms(results, requests, cfg, ideal)
        print("\n" + format_summary(by_concurrency[str(concurrency)], cfg, concurrency), flush=True)
    return {"config": asdict(cfg) | {"prefill_kv_bytes": prefill_kv_bytes,
                                     "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
            "by_concurrency": by_concurrency,
            "workload": {"tenants": [r.kind for r in requests], "prompt_lens": [r.prompt_len for r in requests],
                         "output_lens": [r.output_len for r in requests]}}


def summarize_arms(results: dict[str, dict], requests: list[BenchRequest], cfg: RoutingConfig,
                   ideal: float) -> dict:
    """One concurrency's arms, the simulation replay of its request sequence, and the ratios."""
    cache_blocks = min(v["total_blocks"] for r in results.values() for v in r["per_instance"].values())
    reference = results.get("prefix_aware") or next(iter(results.values()))
    computed = reference["queried_tokens"] - reference["hit_tokens"]
    # The simulated instances compute at the rate the real ones did: computed tokens
    # over the summed TTFTs (which also hold queueing, the KV transfer and one decode
    # step, so a lower bound). It decides how long simulated queues get, and so how
    # often load outweighs a cached prefix.
    ttft_s = sum(t for t in reference["ttfts"] if t is not None)
    prefill_tokens_per_s = max(computed / ttft_s, 1.0) if ttft_s > 0 else 1.0
    sim = replay_in_simulator(requests, reference["start_times"], cfg, cache_blocks, prefill_tokens_per_s)
    summary = {"hit_rate": {p: r["hit_rate"] for p, r in results.items()},
               "mean_ttft_ms": {p: r["mean_ttft_ms"] for p, r in results.items()},
               "simulated_hit_rate": sim, "ideal_hit_rate": ideal, "prefill_cache_blocks": cache_blocks,
               "sim_prefill_tokens_per_s": prefill_tokens_per_s}
    measured = summary["hit_rate"]
    if "prefix_aware" in measured and "round_robin" in measured and measured["round_robin"]:
        summary["prefix_aware_over_round_robin"] = measured["prefix_aware"] / measured["round_robin"]
    # A workload where no prefix repeats (fewer requests than tenants) has nothing to hit:
    # the oracle and the ideal are 0 and a ratio to them means nothing.
    if "prefix_aware" in measured and sim["oracle"] > 0 and ideal > 0:
        summary["prefix_aware_over_simulated_oracle"] = measured["prefix_aware"] / sim["oracle"]
        summary["prefix_aware_over_ideal"] = measured["prefix_aware"] / ideal
    return {"summary": summary, "policies": results}


def format_summary(arms: dict, cfg: RoutingConfig, concurrency: int) -> str:
    s = arms["summary"]
    lines = [f"{cfg.num_tenants} tenants x {cfg.system_prompt_len}-token system prompt, tenant order "
             f"{cfg.tenant_order}, {cfg.num_requests} requests, {concurrency} in flight; "
             f"2 {cfg.cache_role} instances x {s['prefill_cache_blocks']} KV blocks; {cfg.num_gateways} gateway(s)",
             f"{'policy':<14}{'hit rate':>10}{'simulated':>11}{'mean TTFT':>12}"]
    for policy in SIM_POLICIES:
        measured = s["hit_rate"].get(policy)
        ttft = s["mean_ttft_ms"].get(policy)
        lines.append(f"{policy:<14}{'-' if measured is None else f'{measured:.3f}':>10}"
                     f"{s['simulated_hit_rate'][policy]:>11.3f}{'-' if ttft is None else f'{ttft:.0f} ms':>12}")
    lines.append(f"{'ideal':<14}{s['ideal_hit_rate']:>10.3f}  (every system prompt computed once)")
    if not s["ideal_hit_rate"]:
        lines.append("no system prompt repeats in this workload: nothing to hit, no ratios "
                     "(send more requests than tenants)")
    if "prefix_aware_over_round_robin" in s:
        lines.append(f"prefix_aware / round_robin = {s['prefix_aware_over_round_robin']:.2f}x (target >= 2)")
    if "prefix_aware_over_simulated_oracle" in s:
        lines.append(f"prefix_aware / oracle (simulated replay; greedy: the longest cached prefix now, ties by "
                     f"load) = {s['prefix_aware_over_simulated_oracle']:.1%}, / ideal = "
                     f"{s['prefix_aware_over_ideal']:.1%} (target >= 90%)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    d = RoutingConfig()
    parser = EnvDefaultsParser(prog="pdserve bench routing", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default=",".join(d.policies), help="comma list, run in this order")
    parser.add_argument("--num-requests", type=int, default=d.num_requests)
    parser.add_argument("--max-concurrency", default=",".join(map(str, d.concurrencies)),
                        help="requests in flight (closed loop); a comma list runs every policy at each")
    parser.add_argument("--num-tenants", type=int, default=d.num_tenants)
    parser.add_argument("--system-prompt-len", type=int, default=d.system_prompt_len)
    parser.add_argument("--user-len", type=parse_length_range, default=d.user_len_range, help="LOW-HIGH tokens")
    parser.add_argument("--output-len", type=parse_length_range, default=d.output_len_range, help="LOW-HIGH tokens")
    parser.add_argument("--tenant-order", choices=TENANT_ORDERS, default=d.tenant_order)
    parser.add_argument("--prefill-kv-blocks", type=int, default=d.prefill_kv_blocks,
                        help="KV blocks per prefill instance (its prefix cache; with --colocated, per decode "
                             "instance), of the dtype its engine runs")
    parser.add_argument("--decode-kv-memory", default=d.decode_kv_memory, help="the decode instance's KV pool")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--num-gateways", type=int, default=d.num_gateways,
                        help="gateway replicas sharing the instances; requests go to them in turn")
    parser.add_argument("--colocated", action="store_true",
                        help="no prefill pool: 2 decode instances prefill every prompt themselves, each with "
                             "--prefill-kv-blocks blocks, placed by their own KV events; hit rates are theirs")
    parser.add_argument("--json", default=None, metavar="FILE", help="write every figure and the config")
    parser.add_argument("--log-dir", default=None, help="the stack's logs; default: a temporary directory")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        concurrencies = tuple(int(c) for c in args.max_concurrency.split(",") if c.strip())
    except ValueError:
        print(f"pdserve bench routing: error: --max-concurrency takes integers, got {args.max_concurrency!r}",
              file=sys.stderr)
        return 2
    cfg = RoutingConfig(policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
                        num_requests=args.num_requests, concurrencies=concurrencies,
                        num_tenants=args.num_tenants, system_prompt_len=args.system_prompt_len,
                        user_len_range=args.user_len, output_len_range=args.output_len,
                        tenant_order=args.tenant_order, prefill_kv_blocks=args.prefill_kv_blocks,
                        decode_kv_memory=args.decode_kv_memory, seed=args.seed, num_gateways=args.num_gateways,
                        colocated=args.colocated)
    try:
        cfg.check()
    except ValueError as e:
        print(f"pdserve bench routing: error: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        log_dir = args.log_dir or tmp
        print(f"stack logs in {log_dir}", flush=True)
        result = run(cfg, log_dir)
    for concurrency, arms in result["by_concurrency"].items():
        print("\n" + format_summary(arms, cfg, int(concurrency)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(r["failed"] == 0 for arms in result["by_concurrency"].values()
                    for r in arms["policies"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
