"""`pdserve plan`: the cheapest deployment that meets latency SLOs for a given traffic.

    pdserve plan --profile docs/bench/profile-cpu1.json --traffic traffic.json --slo slo.json \\
        --json plan.json --k8s-dir deploy/k8s/capacity
    pdserve plan --profile p.json --rate 2 --input-len 256-768 --output-len 32-96 \\
        --ttft-ms 2000 --tpot-ms 150                                   # the same, from flags

Inputs: a profile (`pdserve profile`: step times of one instance on one machine), a
traffic description (request rate, input and output lengths uniform on LOW-HIGH, the
share of each prompt that is a prefix shared with other requests, burstiness) and SLOs
(TTFT and TPOT at a percentile, p90 by default). Cost is the number of instances: a
prefill or decode instance is one engine on the cores the profile was measured with, so
is a colocated one.

How it decides:
1. An analytic first guess per pool. Prefill instances are a queue: each takes the
   prompts of rate/P requests, a prompt costs S seconds (the profile's prefill step
   time for its uncached tokens, chunked by the token budget), utilisation rho =
   rate/P * E[S]; the mean wait is Pollaczek-Khinchine's rate/P * E[S^2] / (2 (1 - rho)),
   and its tail is taken as exponential (exact for M/M/1): P(W > t) = rho exp(-t rho / E[W]).
   TTFT at the percentile = that wait's quantile + S at the percentile + KV transfer
   + half a decode step (joining decode's batch). Decode instances by Little's law: a
   decode instance holds B = rate/D * (output - 1) * TPOT requests, and a step takes
   TPOT = a + b B + c B X (the profile's decode fit, X the mean context), so
   B = rate/D (out - 1) a / (1 - rate/D (out - 1) (b + c X)), feasible while that is
   positive, within max_num_seqs and the KV pool. Colocated: the same decode batch
   with each step stretched by the prefill work (utilisation rho_p): TPOT / (1 - rho_p).
2. The guess is checked, and the answer found, by simulation (bench.plan_sim: the real
   scheduler and the gateway's real placement): candidates are simulated in order of
   cost, starting one instance below the cheapest guess, until a cost level has
   candidates that meet both SLOs; the one with the most headroom is chosen.
Output: the chosen deployment with its predicted percentiles, the runners-up, the same
deployment with one instance fewer in each pool (what it would miss), Kubernetes
replica counts and HPA bounds (a kustomize overlay, --k8s-dir).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from bench.plan_sim import Deployment, InstanceShape, SimRequest, SimResult, simulate
from bench.profile import Profile
from bench.serve.arrivals import send_offsets


class LengthRange(BaseModel):
    """Token counts uniform on [low, high] (inclusive; low == high: fixed)."""
    model_config = ConfigDict(extra="forbid")
    low: int = Field(ge=1)
    high: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> "LengthRange":
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must be <= high ({self.high})")
        return self

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    def values(self) -> np.ndarray:
        return np.arange(self.low, self.high + 1)

    @classmethod
    def parse(cls, text: str) -> "LengthRange":
        low, sep, high = text.partition("-")
        return cls(low=int(low), high=int(high) if sep else int(low))


class Traffic(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_rate: float = Field(gt=0, description="requests per second")
    input_len: LengthRange
    output_len: LengthRange
    prefix_sharing_ratio: float = Field(0.0, ge=0, lt=1, description="share of each prompt that is a shared prefix")
    num_prefixes: int = Field(8, ge=1, description="distinct shared prefixes")
    burstiness: float = Field(1.0, gt=0, description="gamma shape of arrival gaps: 1 Poisson")


class Slo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttft_ms: float = Field(gt=0)
    tpot_ms: float = Field(gt=0)
    percentile: float = Field(90.0, gt=0, lt=100)


@dataclass(frozen=True)
class PlanOptions:
    shape: InstanceShape = InstanceShape()  # every instance's engine settings
    max_instances: int = 16
    num_requests: int = 400  # simulated per candidate
    seed: int = 0
    allow_colocated: bool = True
    allow_disaggregated: bool = True
    vocab_size: int = 49_152


# ---- the workload the simulation replays -----------------------------------------------


def make_requests(traffic: Traffic, num_requests: int, seed: int = 0, vocab_size: int = 49_152) -> list[SimRequest]:
    """Seeded; arrivals as `pdserve bench serve` sends them (bench.serve.arrivals). A
    prompt's first round(ratio * length) tokens come from one of num_prefixes shared
    prefixes (in turn), the rest are its own."""
    rng = np.random.default_rng(seed)
    arrivals = send_offsets(num_requests, traffic.request_rate, traffic.burstiness, rng)
    input_lens = rng.integers(traffic.input_len.low, traffic.input_len.high + 1, size=num_requests)
    output_lens = rng.integers(traffic.output_len.low, traffic.output_len.high + 1, size=num_requests)
    prefixes = rng.integers(100, vocab_size - 100, size=(traffic.num_prefixes, traffic.input_len.high)).tolist()
    requests = []
    for i, (arrival, n_in, n_out) in enumerate(zip(arrivals.tolist(), input_lens.tolist(), output_lens.tolist())):
        num_shared = round(traffic.prefix_sharing_ratio * n_in)
        prompt = prefixes[i % traffic.num_prefixes][:num_shared] + rng.integers(
            100, vocab_size - 100, size=n_in - num_shared).tolist()
        requests.append(SimRequest(f"req-{i}", arrival, prompt, n_out))
    return requests


# ---- analytic first guess -----------------------------------------------------------------


def prefill_request_s(profile: Profile, num_tokens: int, num_cached: int, budget: int) -> float:
    """One prompt alone on an instance: its uncached tokens in chunks of the token budget."""
    seconds, start = 0.0, num_cached
    while start < num_tokens:
        chunk = min(budget, num_tokens - start)
        seconds += profile.prefill_step_s([(chunk, start)])
        start += chunk
    return seconds


def prefill_service_times(profile: Profile, traffic: Traffic, shape: InstanceShape) -> np.ndarray:
    """S for each possible prompt length (uniform), assuming the shared prefix is cached."""
    lengths = traffic.input_len.values()
    cached = [int(traffic.prefix_sharing_ratio * n) // shape.block_size * shape.block_size for n in lengths]
    return np.array([prefill_request_s(profile, int(n), c, shape.max_num_batched_tokens)
                     for n, c in zip(lengths, cached)])


def mg1_wait_quantile(rate: float, service_s: np.ndarray, p: float) -> tuple[float, float]:
    """(mean wait, p-quantile of the wait) of an M/G/1 queue; inf when rho >= 1.
    Mean: Pollaczek-Khinchine. Tail: P(W > t) = rho exp(-t rho / E[W]) (M/M/1's exact form)."""
    rho = rate * float(service_s.mean())
    if rho >= 1:
        return math.inf, math.inf
    mean_wait = rate * float((service_s ** 2).mean()) / (2 * (1 - rho))
    q = 1 - p / 100
    if rho <= q or mean_wait == 0:
        return mean_wait, 0.0
    return mean_wait, mean_wait / rho * math.log(rho / q)


def decode_batch(profile: Profile, rate_per_instance: float, traffic: Traffic,
                 stretch: float = 1.0) -> tuple[float, float]:
    """(B, TPOT) of one decode instance by Little's law: B = rate (out - 1) TPOT with
    TPOT = stretch * (a + b B + c B X); (inf, inf) when no finite batch satisfies it."""
    fit = profile.decode_fit
    a = fit.intercept_s
    b = fit.coefficients.get("batch", 0.0)
    c = fit.coefficients.get("context", 0.0)
    context_per_request = (traffic.input_len.mean + traffic.output_len.mean / 2) / 1000.0
    steps = rate_per_instance * max(traffic.output_len.mean - 1, 0.0)  # request-steps per second
    denominator = 1 - steps * stretch * (b + c * context_per_request)
    if denominator <= 0:
        return math.inf, math.inf
    batch = steps * stretch * a / denominator
    return batch, stretch * (a + (b + c * context_per_request) * batch)


@dataclass
class Estimate:
    ttft_s: float
    tpot_s: float
    decode_batch: float
    prefill_utilisation: float


def analytic_estimate(profile: Profile, traffic: Traffic, slo: Slo, deployment: Deployment) -> Estimate:
    shape = deployment.decode_shape
    service = prefill_service_times(profile, traffic, deployment.prefill_shape)
    p = slo.percentile
    mean_uncached = traffic.input_len.mean * (1 - traffic.prefix_sharing_ratio)
    if deployment.colocated:
        rate = traffic.request_rate / deployment.num_decode
        rho_p = rate * float(service.mean())
        if rho_p >= 1:
            return Estimate(math.inf, math.inf, math.inf, rho_p)
        batch, tpot = decode_batch(profile, rate, traffic, stretch=1 / (1 - rho_p))
        # A prompt waits for the prompts ahead and shares steps with the decodes.
        _, wait_q = mg1_wait_quantile(rate, service + (tpot if math.isfinite(tpot) else 0.0), p)
        ttft = wait_q + float(np.percentile(service, p)) + (tpot if math.isfinite(tpot) else math.inf)
    else:
        rate = traffic.request_rate / deployment.num_prefill
        rho_p = rate * float(service.mean())
        _, wait_q = mg1_wait_quantile(rate, service, p)
        batch, tpot = decode_batch(profile, traffic.request_rate / deployment.num_decode, traffic)
        ttft = (wait_q + float(np.percentile(service, p)) + profile.transfer_s(int(mean_uncached))
                + (tpot / 2 if math.isfinite(tpot) else math.inf))
    kv_tokens = shape.num_kv_blocks * shape.block_size
    if batch > shape.max_num_seqs or batch * (traffic.input_len.mean + traffic.output_len.mean) > kv_tokens:
        tpot = ttft = math.inf  # the seats or the KV pool cannot hold the batch: requests queue without bound
    return Estimate(ttft, tpot, batch, rho_p)


def meets(estimate_ttft_s: float, estimate_tpot_s: float, slo: Slo) -> bool:
    return estimate_ttft_s * 1000 <= slo.ttft_ms and estimate_tpot_s * 1000 <= slo.tpot_ms


def cheapest_analytic(profile: Profile, traffic: Traffic, slo: Slo, options: PlanOptions) -> dict[str, Deployment]:
    """The analytic guess: the fewest prefill instances whose TTFT fits (with decode
    ample), the fewest decode ones whose TPOT fits, and the fewest colocated ones."""
    limit, shape = options.max_instances, options.shape
    guesses: dict[str, Deployment] = {}
    if options.allow_disaggregated:
        num_decode = next((d for d in range(1, limit) if meets(0.0, analytic_estimate(
            profile, traffic, slo, Deployment(1, d, shape, shape)).tpot_s, slo)), limit - 1)
        num_prefill = next((p for p in range(1, limit) if meets(analytic_estimate(
            profile, traffic, slo, Deployment(p, num_decode, shape, shape)).ttft_s, 0.0, slo)), limit - 1)
        guesses["disaggregated"] = Deployment(num_prefill, num_decode, shape, shape)
    if options.allow_colocated:
        num_colocated = next((n for n in range(1, limit + 1) if meets(*_ttft_tpot(analytic_estimate(
            profile, traffic, slo, Deployment(0, n, shape, shape))), slo)), limit)
        guesses["colocated"] = Deployment(0, num_colocated, shape, shape)
    return guesses


def _ttft_tpot(estimate: Estimate) -> tuple[float, float]:
    return estimate.ttft_s, estimate.tpot_s


# ---- simulation-checked search ------------------------------------------------------------


@dataclass
class Candidate:
    deployment: Deployment
    analytic: Estimate
    simulated: SimResult

    def predicted(self, metric: str, p: float) -> float:
        return self.simulated.percentile(metric, p)

    def headroom(self, slo: Slo) -> float:
        """The smaller of SLO / predicted over both metrics: > 1 meets both."""
        ttft = self.predicted("ttft", slo.percentile) * 1000
        tpot = self.predicted("tpot", slo.percentile) * 1000
        return min(slo.ttft_ms / ttft if ttft else math.inf, slo.tpot_ms / tpot if tpot else math.inf)

    def meets(self, slo: Slo) -> bool:
        return self.simulated.completed == len(self.simulated.requests) and self.headroom(slo) >= 1.0

    def summary(self, slo: Slo) -> dict:
        r = self.simulated
        out = {"deployment": self.deployment.label(), "num_prefill": self.deployment.num_prefill,
               "num_decode": self.deployment.num_decode, "num_instances": self.deployment.num_instances,
               "colocated": self.deployment.colocated, "meets_slo": self.meets(slo),
               "headroom": round(self.headroom(slo), 3),
               "analytic": {"ttft_ms": _ms(self.analytic.ttft_s), "tpot_ms": _ms(self.analytic.tpot_s),
                            "decode_batch": _round(self.analytic.decode_batch),
                            "prefill_utilisation": _round(self.analytic.prefill_utilisation)},
               "simulated": {"mean_decode_batch": round(r.mean_decode_batch, 2),
                             "decode_utilisation": round(r.decode_utilisation, 3),
                             "prefill_utilisation": round(r.prefill_utilisation, 3),
                             "prefix_hit_rate": round(r.prefix_hit_rate, 3), "num_preemptions": r.num_preemptions}}
        for metric in ("ttft", "tpot"):
            for p in sorted({50.0, slo.percentile, 99.0}):
                out["simulated"][f"p{p:g}_{metric}_ms"] = _ms(self.predicted(metric, p))
        return out


def _ms(seconds: float) -> float | None:
    return round(seconds * 1000, 1) if math.isfinite(seconds) else None


def _round(value: float) -> float | None:
    return round(value, 3) if math.isfinite(value) else None


@dataclass
class Plan:
    chosen: Candidate | None
    candidates: list[Candidate]  # every one simulated, cheapest first
    smaller: list[Candidate]  # the chosen one less one instance in each pool
    guesses: dict[str, Deployment]


class Planner:
    def __init__(self, profile: Profile, traffic: Traffic, slo: Slo, options: PlanOptions = PlanOptions()):
        self.profile, self.traffic, self.slo, self.options = profile, traffic, slo, options
        self.requests = make_requests(traffic, options.num_requests, options.seed, options.vocab_size)
        self.simulated: dict[tuple[int, int], Candidate] = {}

    def evaluate(self, deployment: Deployment) -> Candidate:
        key = (deployment.num_prefill, deployment.num_decode)
        if key not in self.simulated:
            estimate = analytic_estimate(self.profile, self.traffic, self.slo, deployment)
            self.simulated[key] = Candidate(deployment, estimate, simulate(deployment, self.profile, self.requests))
        return self.simulated[key]

    def deployment(self, num_prefill: int, num_decode: int) -> Deployment:
        return Deployment(num_prefill, num_decode, self.options.shape, self.options.shape)

    def candidates_at(self, cost: int, guesses: dict[str, Deployment]) -> list[Deployment]:
        """Deployments of this many instances worth simulating: colocated, and the
        disaggregated splits within one instance of the guess's proportions."""
        out = []
        if self.options.allow_colocated:
            out.append(self.deployment(0, cost))
        guess = guesses.get("disaggregated")
        if guess is not None and cost >= 2:
            share = guess.num_prefill / guess.num_instances
            centre = min(max(round(cost * share), 1), cost - 1)
            for num_prefill in sorted({min(max(centre + k, 1), cost - 1) for k in (-1, 0, 1)}):
                out.append(self.deployment(num_prefill, cost - num_prefill))
        return out

    def plan(self) -> Plan:
        guesses = cheapest_analytic(self.profile, self.traffic, self.slo, self.options)
        start = max(1, min(g.num_instances for g in guesses.values()) - 1)
        chosen = None
        for cost in range(start, self.options.max_instances + 1):
            passing = [c for c in map(self.evaluate, self.candidates_at(cost, guesses)) if c.meets(self.slo)]
            if passing:
                chosen = max(passing, key=lambda c: c.headroom(self.slo))
                break
        smaller = []
        if chosen is not None:
            d = chosen.deployment
            shrunk = [(d.num_prefill, d.num_decode - 1)] if d.colocated else [
                (d.num_prefill - 1, d.num_decode), (d.num_prefill, d.num_decode - 1)]
            smaller = [self.evaluate(self.deployment(p, n)) for p, n in shrunk if n >= 1 and p >= 0]
        candidates = sorted(self.simulated.values(),
                            key=lambda c: (c.deployment.num_instances, -c.headroom(self.slo)))
        return Plan(chosen, candidates, smaller, guesses)


# ---- Kubernetes -----------------------------------------------------------------------------


def k8s_overlay(plan: Plan, peak_factor: float, description: str = "") -> dict[str, str]:
    """A kustomize overlay over deploy/k8s: the planned replicas per pool, HPA bounds
    from them (min = the plan; max = replicas x peak_factor, rounded up: a pool's size
    grows about linearly with the rate, so that is the room for peak_factor x the
    planned rate). `description` (what was planned for) heads the kustomization."""
    d = plan.chosen.deployment
    pools = {"decode": d.num_decode} if d.colocated else {"prefill": d.num_prefill, "decode": d.num_decode}
    patches: dict[str, str] = {}  # one strategic-merge patch per file
    for pool, replicas in pools.items():
        patches[f"deployment-{pool}.yaml"] = f"""apiVersion: apps/v1
kind: Deployment
metadata:
  name: pdserve-{pool}
spec:
  replicas: {replicas}  # pdserve plan: {d.label()}
"""
        patches[f"hpa-{pool}.yaml"] = f"""apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: pdserve-{pool}
spec:
  minReplicas: {replicas}
  maxReplicas: {max(replicas, math.ceil(replicas * peak_factor))}
"""
    if d.colocated:  # no prefill pool: decode instances prefill locally
        patches["deployment-prefill.yaml"] = """apiVersion: apps/v1
kind: Deployment
metadata:
  name: pdserve-prefill
spec:
  replicas: 0  # pdserve plan: colocated, decode prefills locally
"""
        patches["hpa-prefill.yaml"] = """# An HPA cannot hold a pool at 0 replicas (minReplicas >= 1): drop the prefill one.
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: pdserve-prefill
$patch: delete
"""
    header = "".join(f"# {line}\n" for line in description.splitlines())
    kustomization = header + """# Written by `pdserve plan`: the planned replica counts and HPA bounds over deploy/k8s.
#   kubectl apply -k deploy/k8s/capacity
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ..
patches:
""" + "".join(f"  - path: {name}\n" for name in sorted(patches))
    return {"kustomization.yaml": kustomization, **patches}


# ---- validation on a real stack ------------------------------------------------------------


def bench_serve_args(traffic: Traffic, num_prompts: int, seed: int) -> list[str]:
    """`pdserve bench serve` flags for this traffic: its random dataset draws lengths
    uniform on [L (1 - r), L (1 + r)], which is [low, high] for L = the mean and
    r = (high - low) / (high + low)."""
    if traffic.prefix_sharing_ratio:
        raise ValueError("validation replays the random dataset: plan it with --prefix-sharing 0")

    def length(r: LengthRange) -> list[str]:
        return [str(round(r.mean)), str((r.high - r.low) / (r.high + r.low))]
    (in_len, in_ratio), (out_len, out_ratio) = length(traffic.input_len), length(traffic.output_len)
    if in_ratio != out_ratio and traffic.input_len.low != traffic.input_len.high and \
            traffic.output_len.low != traffic.output_len.high:
        raise ValueError("bench serve takes one --random-range-ratio: input and output ranges need the same "
                         "(high - low) / (high + low)")
    ratio = in_ratio if traffic.input_len.low != traffic.input_len.high else out_ratio
    return ["--dataset-name", "random", "--random-input-len", in_len, "--random-output-len", out_len,
            "--random-range-ratio", ratio, "--request-rate", str(traffic.request_rate),
            "--burstiness", str(traffic.burstiness), "--num-prompts", str(num_prompts), "--seed", str(seed),
            "--metric-percentiles", "50,90,99", "--disable-tqdm"]


def measure_on_stack(deployment: Deployment, traffic: Traffic, shape: InstanceShape, kv_cache_memory: str,
                     num_prompts: int, seed: int, workdir: Path, threads_per_instance: int = 1,
                     dtype: str = "auto") -> dict:
    """Start the deployment as a LocalStack (`pdserve up`), every engine with the plan's
    settings and the profile's threads and dtype, decode never prefilling a prompt when a prefill
    instance is alive (--local-prefill-threshold 0, as the simulation assumes), then
    run `pdserve bench serve` at the planned traffic. Returns bench serve's figures."""
    from bench.serve.main import main as bench_serve
    from common.cli.up import LocalStack
    flags = ["--max-num-seqs", str(shape.max_num_seqs), "--max-num-batched-tokens", str(shape.max_num_batched_tokens),
             "--kv-cache-memory", kv_cache_memory, "--max-running-per-decode", str(shape.max_num_seqs),
             "--local-prefill-threshold", "0", "--log-level", "WARNING", "--dtype", dtype,
             # The profile's threads: `up` would otherwise give each engine its share of the
             # host's cores (a lone instance two threads on two cores, faster than profiled).
             "--num-threads", str(threads_per_instance)]
    out = workdir / f"serve-{deployment.label().replace(' ', '')}.json"
    with LocalStack(deployment.num_prefill, deployment.num_decode, passthrough=flags, http_port=None,
                    env={"OMP_NUM_THREADS": str(threads_per_instance)}, log_dir=workdir) as stack:
        code = bench_serve(["--gateway", stack.address, *bench_serve_args(traffic, num_prompts, seed),
                            "--json", str(out)])
    if code != 0 or not out.exists():
        raise RuntimeError(f"bench serve against {deployment.label()} failed (exit {code})")
    (run,) = json.loads(out.read_text())["runs"]
    return run


def validate(plan: Plan, profile: Profile, traffic: Traffic, slo: Slo, shape: InstanceShape, kv_cache_memory: str,
             num_prompts: int, seed: int, workdir: Path, repeats: int = 1) -> list[dict]:
    """Predicted vs measured percentiles for the chosen deployment and each one smaller.
    With repeats > 1 the deployments take turns (A, B, A, B, ...) so that load from other
    work on the machine, which drifts over minutes, falls on each alike; the measured
    figure is the median over the repeats (each repeat's is kept, with the load average
    when it started). The stacks run the engine the profile measured (its threads and
    dtype).

    Each prediction compared is re-simulated for the runs' own workload: num_prompts
    requests (seed + repeat), the median over the repeats like the measured figure. The
    plan's steady-state figure (its longer simulated run) is kept beside it: for a
    deployment past its capacity the queue, and so TTFT, grows with the run's length, and
    a 60-request run cannot reach the steady state's queue."""
    import os
    candidates = [plan.chosen, *plan.smaller]
    runs: dict[str, list[dict]] = {c.deployment.label(): [] for c in candidates}
    for repeat in range(repeats):
        for candidate in candidates:
            load_average = os.getloadavg()[0]
            measured = measure_on_stack(candidate.deployment, traffic, shape, kv_cache_memory, num_prompts,
                                        seed + repeat, workdir, threads_per_instance=profile.machine.num_threads,
                                        dtype=profile.engine.dtype)
            measured["load_average_at_start"] = round(load_average, 2)
            runs[candidate.deployment.label()].append(measured)
            print(json.dumps({"deployment": candidate.deployment.label(), "repeat": repeat,
                              "load_average_at_start": round(load_average, 2),
                              **{k: measured.get(k) for k in ("p90_ttft_ms", "p90_tpot_ms", "completed")}}), flush=True)
    rows = []
    for candidate in candidates:
        measured_runs = runs[candidate.deployment.label()]
        row = {"deployment": candidate.deployment.label(), "chosen": candidate is plan.chosen,
               "completed": sum(r["completed"] for r in measured_runs),
               "failed": sum(r.get("failed") or 0 for r in measured_runs),
               "runs": [{"load_average_at_start": r["load_average_at_start"],
                         **{f"p{p}_{m}_ms": r.get(f"p{p}_{m}_ms") for m in ("ttft", "tpot") for p in (50, 90, 99)}}
                        for r in measured_runs]}
        same_runs = [simulate(candidate.deployment, profile, make_requests(traffic, num_prompts, seed + repeat))
                     for repeat in range(repeats)]
        for metric in ("ttft", "tpot"):
            for p in (50, 90, 99):
                steady = candidate.predicted(metric, p) * 1000
                predicted = float(np.median([r.percentile(metric, p) for r in same_runs])) * 1000
                real = [r.get(f"p{p}_{metric}_ms") for r in measured_runs]
                real = None if None in real else float(np.median(real))
                row[f"p{p}_{metric}_ms"] = {"predicted": round(predicted, 1) if math.isfinite(predicted) else None,
                                            "predicted_steady": round(steady, 1) if math.isfinite(steady) else None,
                                            "measured": None if real is None else round(real, 1)}
        key = f"p{slo.percentile:g}"
        ttft, tpot = row.get(f"{key}_ttft_ms"), row.get(f"{key}_tpot_ms")
        if ttft and tpot and ttft["measured"] is not None and tpot["measured"] is not None:
            row["measured_meets_slo"] = ttft["measured"] <= slo.ttft_ms and tpot["measured"] <= slo.tpot_ms
            row["predicted_meets_slo"] = candidate.meets(slo)
            for name, pair in (("ttft", ttft), ("tpot", tpot)):
                if pair["predicted"] is not None:
                    row[f"{key}_{name}_error"] = round(pair["predicted"] / pair["measured"] - 1, 3)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
    return rows


# ---- the command ------------------------------------------------------------------------------


def plan_report(plan: Plan, traffic: Traffic, slo: Slo, profile: Profile) -> dict:
    return {"traffic": traffic.model_dump(), "slo": slo.model_dump(),
            "profile": {"machine": profile.machine.model_dump(), "versions": profile.versions.model_dump(),
                        "engine": profile.engine.model_dump()},
            "analytic_guess": {k: d.label() for k, d in plan.guesses.items()},
            "chosen": plan.chosen.summary(slo) if plan.chosen else None,
            "runners_up": [c.summary(slo) for c in plan.candidates if c is not plan.chosen],
            "one_fewer": [c.summary(slo) for c in plan.smaller]}


def print_plan(plan: Plan, slo: Slo) -> None:
    p = slo.percentile
    print(f"analytic first guess: {', '.join(f'{k} {d.label()}' for k, d in plan.guesses.items())}")
    print(f"{'deployment':<16}{'instances':>10}{f'TTFT p{p:g}':>13}{f'TPOT p{p:g}':>13}  meets SLO "
          f"(TTFT {slo.ttft_ms:g} ms, TPOT {slo.tpot_ms:g} ms)")
    for c in plan.candidates:
        mark = " <- chosen" if c is plan.chosen else ""
        print(f"{c.deployment.label():<16}{c.deployment.num_instances:>10}"
              f"{_fmt(c.predicted('ttft', p)):>13}{_fmt(c.predicted('tpot', p)):>13}  "
              f"{'yes' if c.meets(slo) else 'no'}{mark}")
    if plan.chosen is None:
        print("no deployment within --max-instances meets the SLOs")


def _fmt(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if math.isfinite(seconds) else "inf"


def load_model(cls, path: str | None, fallback: dict):
    if path:
        return cls.model_validate_json(Path(path).read_text())
    return cls.model_validate(fallback)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", required=True, help="JSON from `pdserve profile`")
    parser.add_argument("--traffic", default=None, help="traffic JSON (Traffic); or the flags below")
    parser.add_argument("--rate", type=float, default=None, help="requests per second")
    parser.add_argument("--input-len", default="512", help="LOW-HIGH prompt tokens, uniform")
    parser.add_argument("--output-len", default="128", help="LOW-HIGH output tokens, uniform")
    parser.add_argument("--prefix-sharing", type=float, default=0.0,
                        help="share of each prompt that is a shared prefix")
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--slo", default=None, help="SLO JSON (Slo); or the flags below")
    parser.add_argument("--ttft-ms", type=float, default=None)
    parser.add_argument("--tpot-ms", type=float, default=None)
    parser.add_argument("--percentile", type=float, default=90.0)
    engine = parser.add_argument_group("every instance's engine settings (e.g. `pdserve tune`'s choice)")
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV pool blocks per instance; default: --kv-cache-memory over the profile's bytes "
                             "per token")
    engine.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--max-instances", type=int, default=16)
    parser.add_argument("--no-colocated", action="store_true", help="plan disaggregated deployments only")
    parser.add_argument("--num-requests", type=int, default=400, help="requests simulated per candidate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the plan as JSON")
    parser.add_argument("--k8s-dir", default=None, help="write a kustomize overlay with the replicas and HPA bounds")
    parser.add_argument("--peak-factor", type=float, default=2.0, help="HPA maxReplicas = replicas x this")
    check = parser.add_argument_group("validation on a real local stack (pdserve up + pdserve bench serve)")
    check.add_argument("--validate", action="store_true",
                       help="run the chosen deployment and each one instance smaller, and compare percentiles")
    check.add_argument("--validate-prompts", type=int, default=60, help="requests per validation run")
    check.add_argument("--validate-dir", default=None, help="where stack logs and bench serve JSON go")
    check.add_argument("--validate-repeats", type=int, default=1,
                       help="runs per deployment, taking turns (median reported): evens out drifting load")
    return parser


def main(argv: list[str] | None = None) -> int:
    from common.engine.config import parse_memory_size
    args = build_parser().parse_args(argv)
    try:
        profile = Profile.load(args.profile)
        traffic = load_model(Traffic, args.traffic, {
            "request_rate": args.rate, "input_len": LengthRange.parse(args.input_len).model_dump(),
            "output_len": LengthRange.parse(args.output_len).model_dump(),
            "prefix_sharing_ratio": args.prefix_sharing, "num_prefixes": args.num_prefixes,
            "burstiness": args.burstiness})
        slo = load_model(Slo, args.slo, {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms,
                                         "percentile": args.percentile})
    except (ValueError, OSError) as e:  # pydantic's ValidationError is a ValueError
        print(f"pdserve plan: error: {e}", file=sys.stderr)
        return 2
    block_size = profile.engine.block_size
    num_blocks = args.num_kv_blocks or int(parse_memory_size(args.kv_cache_memory)) // (
        profile.engine.kv_bytes_per_token * block_size)
    shape = InstanceShape(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          num_kv_blocks=num_blocks, block_size=block_size,
                          max_model_len=traffic.input_len.high + traffic.output_len.high)
    options = PlanOptions(shape=shape, max_instances=args.max_instances, num_requests=args.num_requests,
                          seed=args.seed, allow_colocated=not args.no_colocated)
    plan = Planner(profile, traffic, slo, options).plan()
    print_plan(plan, slo)
    report = plan_report(plan, traffic, slo, profile)
    if plan.chosen:
        for c in plan.smaller:
            print(f"one fewer: {c.deployment.label()} -> TTFT p{slo.percentile:g} "
                  f"{_fmt(c.predicted('ttft', slo.percentile))}, TPOT {_fmt(c.predicted('tpot', slo.percentile))}"
                  f" ({'meets' if c.meets(slo) else 'misses'} the SLO)")
    if args.validate and plan.chosen:
        import tempfile
        workdir = Path(args.validate_dir or tempfile.mkdtemp(prefix="pdserve-plan-"))
        workdir.mkdir(parents=True, exist_ok=True)
        report["validation"] = validate(plan, profile, traffic, slo, shape, args.kv_cache_memory,
                                        args.validate_prompts, args.seed, workdir, args.validate_repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    if args.k8s_dir and plan.chosen:
        out = Path(args.k8s_dir)
        out.mkdir(parents=True, exist_ok=True)
        description = (f"{plan.chosen.deployment.label()} for {traffic.model_dump_json()}\n"
                       f"SLO {slo.model_dump_json()}; profile {args.profile} ({profile.machine.cpu_model}, "
                       f"{profile.machine.num_threads} thread(s) per instance, pdserve {profile.versions.git_commit})")
        for name, text in k8s_overlay(plan, args.peak_factor, description).items():
            (out / name).write_text(text)
        print(f"wrote {out}/kustomization.yaml and its patches")
    return 0 if plan.chosen else 1


if __name__ == "__main__":
    sys.exit(main())
