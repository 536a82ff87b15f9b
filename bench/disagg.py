"""Disaggregated vs colocated serving on the real stack (issue 7): `pdserve bench disagg`.

    pdserve bench disagg --json docs/bench/disagg.json --plot docs/bench
    pdserve bench disagg --rates 0.1 --long-duration 20 --arms disaggregated,colocated  # smoke

Three arms, each a real LocalStack on the same two cores, run one after the other:

- disaggregated: 1 prefill + 1 decode; the prefill process pinned to the first core,
  the decode process to the second (torch sizes its thread pool to the affinity,
  OMP_NUM_THREADS set to match: one thread each); `--local-prefill-threshold 0`, so
  the decode instance never prefills: every prompt goes to the prefill instance.
- colocated: 0 prefill + 1 decode allowed both cores (two threads), no chunked
  prefill (`--no-chunked-prefill`, `--max-num-batched-tokens 4096` so a whole 2k
  prompt fits one step next to the running decodes, as vLLM requires of unchunked
  engines); it prefills every prompt itself.
- colocated-chunked: the same with chunked prefill and a per-step token budget of
  --chunk-tokens (default 256), so a long prompt is cut into chunks that share steps
  with the decodes.
The gateway and this client float on both cores in every arm.

Workload, per offered rate (the same seeded requests for every arm):
- --decode-streams (8) closed-loop decode streams: each sends a short prompt (32-64
  tokens) for 64-192 output tokens (mean 128, short enough that several finish inside
  a window on this CPU) and, when it ends, the next; they run for the whole
  measurement, so long prompts always arrive among running decodes;
- a Poisson stream of long prompts (1024-2048 tokens, 16 output tokens) at the
  offered rate, round(rate x --long-duration) of them (at least 2).
The measurement window opens when every decode stream has its first token and the
long prompts start, and closes when the last long prompt finishes (or after
--max-window seconds); decode streams still running then are cancelled.

Figures, over the window: ITL of the decode streams (every gap between consecutive
tokens that ends inside the window: what decode waiting behind a prefill shows up
in), TPOT of decode requests that finished in it, TTFT of both kinds, output tokens/s,
and goodput: requests finished in the window that meet the SLO (--slo-ttft-ms and
--slo-tpot-ms, every request, vLLM's per-request TTFT and TPOT) per second. The client
self-check (`pdserve bench serve --self-check`, the same in-process fake) is run first
and compared with the fastest arm's token rate.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from bench.serve.arrivals import parse_rates, send_offsets
from bench.serve.datasets import BenchRequest, Vocabulary, parse_length_range, ranged_requests
from bench.serve.metrics import RequestOutcome, summarize
from common.service.flags import EnvDefaultsParser

DECODE, LONG = "decode", "long-prefill"
PERCENTILES = (50, 90, 99, 99.9)
ARM_NAMES = ("disaggregated", "colocated", "colocated-chunked")


@dataclass(frozen=True)
class DisaggConfig:
    arms: tuple[str, ...] = ARM_NAMES
    rates: tuple[float, ...] = (0.04, 0.08, 0.12)  # long prompts per second
    long_duration_s: float = 40.0
    max_window_s: float = 180.0
    num_decode_streams: int = 8
    decode_input_range: tuple[int, int] = (32, 64)
    decode_output_range: tuple[int, int] = (64, 192)
    long_input_range: tuple[int, int] = (1024, 2048)
    long_output_len: int = 16
    chunk_tokens: int = 256
    unchunked_budget_tokens: int = 4096
    kv_cache_memory: str = "1GiB"
    slo_ttft_ms: float = 10_000.0
    slo_tpot_ms: float = 500.0
    seed: int = 0

    def check(self) -> None:
        unknown = [a for a in self.arms if a not in ARM_NAMES]
        if unknown or not self.arms:
            raise ValueError(f"--arms: choose from {', '.join(ARM_NAMES)}; got {','.join(self.arms)}")
        if not self.rates or any(not (0 < r < float("inf")) for r in self.rates):
            raise ValueError("--rates must be finite and > 0 (long prompts per second)")
        if self.num_decode_streams < 1 or self.long_duration_s <= 0 or self.max_window_s <= 0:
            raise ValueError("--decode-streams, --long-duration and --max-window must be > 0")
        if self.long_input_range[1] > self.unchunked_budget_tokens:
            raise ValueError("the longest prompt must fit the unchunked arm's token budget")
        if self.chunk_tokens < 16:
            raise ValueError("--chunk-tokens must be >= 16")

    def num_long(self, rate: float) -> int:
        return max(2, round(rate * self.long_duration_s))


@dataclass(frozen=True)
class Arm:
    name: str
    num_prefill: int
    passthrough: tuple[str, ...]
    cpu_affinity: dict[str, frozenset[int]] = field(hash=False)
    description: str = ""


def usable_cpus() -> tuple[int, int]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError(f"the arms need two cores; this process may use {cpus}")
    return cpus[0], cpus[1]


def make_arms(cfg: DisaggConfig, cpus: tuple[int, int]) -> list[Arm]:
    """The three arms of issue 7, on the two given cores; only those named in cfg.arms."""
    first, second = cpus
    common = ("--kv-cache-memory", cfg.kv_cache_memory, "--log-level", "WARNING")
    everything_local = ("--local-prefill-threshold", "1000000000")  # no prefill pool anyway
    arms = {
        "disaggregated": Arm(
            "disaggregated", 1, (*common, "--local-prefill-threshold", "0"),
            {"prefill": frozenset({first}), "decode": frozenset({second})},
            f"1 prefill (core {first}) + 1 decode (core {second}), decode never prefills"),
        "colocated": Arm(
            "colocated", 0, (*common, *everything_local, "--no-chunked-prefill",
                             "--max-num-batched-tokens", str(cfg.unchunked_budget_tokens)),
            {"decode": frozenset({first, second})},
            f"1 engine on cores {first},{second}, prefill unchunked"),
        "colocated-chunked": Arm(
            "colocated-chunked", 0, (*common, *everything_local,
                                     "--max-num-batched-tokens", str(cfg.chunk_tokens)),
            {"decode": frozenset({first, second})},
            f"1 engine on cores {first},{second}, chunked prefill ({cfg.chunk_tokens}-token steps)"),
    }
    return [arms[name] for name in cfg.arms]


# ---- the workload ---------------------------------------------------------------------

def decode_request_stream(cfg: DisaggConfig, vocab: Vocabulary, seed: int) -> Iterator[BenchRequest]:
    """An endless, seeded supply of decode-stream requests."""
    rng = np.random.default_rng([seed, 1])
    while True:
        yield from ranged_requests(64, vocab, rng, cfg.decode_input_range, cfg.decode_output_range, DECODE)


def long_requests(cfg: DisaggConfig, vocab: Vocabulary, rate_index: int, rate: float) -> list[BenchRequest]:
    rng = np.random.default_rng([cfg.seed, 2, rate_index])
    return ranged_requests(cfg.num_long(rate), vocab, rng, cfg.long_input_range,
                           (cfg.long_output_len, cfg.long_output_len), LONG)


# ---- one run: decode streams plus a Poisson stream of long prompts ---------------------

@dataclass
class TrackedOutcome:
    kind: str
    outcome: RequestOutcome
    stream: int = -1  # which decode stream sent it (-1: a long prompt)
    done: bool = False  # its stream ended (successfully or not)


@dataclass
class MixedRun:
    outcomes: list[TrackedOutcome]
    window_start_s: float  # relative to the run's start, like each outcome's start_s
    window_end_s: float
    timed_out: bool = False


async def _track(backend, request: BenchRequest, outcome: RequestOutcome, t0: float) -> None:
    """Stream one request into `outcome`, which keeps what arrived even if cancelled."""
    from bench.serve.client import describe_error
    sent = time.perf_counter()
    outcome.start_s = sent - t0
    try:
        async for arrival, num_tokens in backend.stream(request):
            if num_tokens > 0:
                outcome.chunk_offsets_s.append(arrival - sent)
                outcome.chunk_tokens.append(num_tokens)
    except asyncio.CancelledError:
        outcome.error = "cancelled: the measurement window closed"
        raise
    except Exception as error:  # noqa: BLE001 -- one failed request, recorded
        outcome.error = describe_error(error)
    if not outcome.error and not outcome.chunk_offsets_s:
        outcome.error = "the stream ended without a single token"


async def _track_long(backend, request: BenchRequest, item: TrackedOutcome, t0: float) -> None:
    await _track(backend, request, item.outcome, t0)
    item.done = True


async def run_mixed(backend, decode_requests: Iterator[BenchRequest], long_prompts: list[BenchRequest],
                    rate: float, num_streams: int, seed: int, max_window_s: float,
                    warmup_timeout_s: float = 300.0, progress_every_s: float = 15.0) -> MixedRun:
    t0 = time.perf_counter()
    tracked: list[TrackedOutcome] = []
    stop = asyncio.Event()

    async def decode_stream(index: int) -> None:
        while not stop.is_set():
            request = next(decode_requests)
            item = TrackedOutcome(DECODE, RequestOutcome(prompt_len=request.prompt_len), index)
            tracked.append(item)
            await _track(backend, request, item.outcome, t0)
            item.done = True

    decode_tasks = [asyncio.create_task(decode_stream(i)) for i in range(num_streams)]
    long_tasks: list[asyncio.Task] = []
    timed_out = False
    try:
        deadline = time.perf_counter() + warmup_timeout_s
        while len({t.stream for t in tracked if t.kind == DECODE and t.outcome.chunk_offsets_s}) < num_streams:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"decode streams without a first token after {warmup_timeout_s:.0f}s")
            failed = [t.outcome.error for t in tracked if t.outcome.error]
            if failed:
                raise RuntimeError(f"a decode stream failed before the window opened: {failed[0]}")
            await asyncio.sleep(0.05)
        window_start = time.perf_counter() - t0
        offsets = send_offsets(len(long_prompts), rate, 1.0, seed)
        reporter = asyncio.create_task(_report_progress(tracked, len(long_prompts), t0, window_start,
                                                        progress_every_s))
        try:
            for request, offset in zip(long_prompts, offsets):
                delay = t0 + window_start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                item = TrackedOutcome(LONG, RequestOutcome(prompt_len=request.prompt_len))
                tracked.append(item)
                long_tasks.append(asyncio.create_task(_track_long(backend, request, item, t0)))
            left = max_window_s - (time.perf_counter() - t0 - window_start)
            _, pending = await asyncio.wait(long_tasks, timeout=max(left, 0.0))
            timed_out = bool(pending)
        finally:
            reporter.cancel()
        window_end = time.perf_counter() - t0
    finally:
        stop.set()
        for task in [*decode_tasks, *long_tasks]:
            task.cancel()
        await asyncio.gather(*decode_tasks, *long_tasks, return_exceptions=True)
    return MixedRun(tracked, window_start, window_end, timed_out)


async def _report_progress(tracked: list[TrackedOutcome], num_long: int, t0: float, window_start: float,
                           every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        longs = [t for t in tracked if t.kind == LONG]
        decode_tokens = sum(t.outcome.output_tokens for t in tracked if t.kind == DECODE)
        print(f"     {time.perf_counter() - t0 - window_start:5.0f}s into the window: long prompts sent "
              f"{len(longs)}/{num_long}, with a first token {sum(bool(t.outcome.chunk_offsets_s) for t in longs)}, "
              f"done {sum(t.done for t in longs)}; decode tokens so far {decode_tokens}", flush=True)


# ---- figures of one run ---------------------------------------------------------------

def _end_s(outcome: RequestOutcome) -> float:
    return outcome.start_s + outcome.chunk_offsets_s[-1]


def window_metrics(run: MixedRun, slo_ttft_ms: float, slo_tpot_ms: float,
                   percentiles: tuple[float, ...] = PERCENTILES) -> dict:
    """The run's figures over its window (see the module doc for what counts)."""
    start, end = run.window_start_s, run.window_end_s
    length = max(end - start, 1e-9)
    decode = [t.outcome for t in run.outcomes if t.kind == DECODE]
    long = [t.outcome for t in run.outcomes if t.kind == LONG]
    itls = []
    output_tokens = 0
    for outcome in decode + long:
        for offset, num_tokens in zip(outcome.chunk_offsets_s, outcome.chunk_tokens):
            if start <= outcome.start_s + offset <= end:
                output_tokens += num_tokens
    for outcome in decode:
        offsets = outcome.chunk_offsets_s
        itls += [later - earlier for earlier, later in zip(offsets, offsets[1:])
                 if start <= outcome.start_s + later <= end]
    finished = {kind: [o for o in outcomes if o.success and start <= _end_s(o) <= end]
                for kind, outcomes in ((DECODE, decode), (LONG, long))}

    def good(outcome: RequestOutcome) -> bool:
        return outcome.ttft_s * 1000 <= slo_ttft_ms and (outcome.tpot_s or 0.0) * 1000 <= slo_tpot_ms

    figures = {
        "window_s": length, "timed_out": run.timed_out,
        "num_long": len(long), "long_completed": sum(o.success for o in long),
        "long_failed": sum(bool(o.error) for o in long),
        "decode_finished": len(finished[DECODE]),
        "decode_failed": sum(bool(o.error) and not o.error.startswith("cancelled") for o in decode),
        "num_itl_samples": len(itls),
        "output_throughput": output_tokens / length,
        "request_throughput": (len(finished[DECODE]) + len(finished[LONG])) / length,
        "request_goodput": sum(good(o) for kind in finished for o in finished[kind]) / length,
        "decode_goodput": sum(good(o) for o in finished[DECODE]) / length,
        "long_goodput": sum(good(o) for o in finished[LONG]) / length,
        "max_itl_ms": max(itls) * 1000 if itls else None,
        # Per-token percentiles hide a few long stalls; the share of decode time spent
        # in gaps over 1 s shows them whatever their number.
        "decode_time_in_gaps_over_1s": (sum(g for g in itls if g > 1.0) / sum(itls)) if itls else None,
    }
    figures.update(summarize("itl", itls, list(percentiles)))
    figures.update(summarize("tpot", [o.tpot_s for o in finished[DECODE] if o.tpot_s is not None],
                             list(percentiles)))
    figures.update({f"decode_{k}": v for k, v in summarize(
        "ttft", [o.ttft_s for o in decode if o.chunk_offsets_s and start <= o.start_s <= end],
        list(percentiles)).items()})
    figures.update({f"long_{k}": v for k, v in summarize(
        "ttft", [o.ttft_s for o in long if o.chunk_offsets_s], list(percentiles)).items()})
    figures["itls_ms"] = [round(g * 1000, 2) for g in itls]
    # Enough to recompute goodput at any other SLO: every request finished in the window.
    done = [(kind, o) for kind in finished for o in finished[kind]]
    figures["finished"] = {"kind": [k for k, _ in done], "ttft_ms": [round(o.ttft_s * 1000, 1) for _, o in done],
                           "tpot_ms": [None if o.tpot_s is None else round(o.tpot_s * 1000, 2) for _, o in done]}
    return figures


def goodput_at(run: dict, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """A saved run's goodput figures at another SLO, from its finished requests."""
    finished = run["finished"]
    good = [kind for kind, ttft, tpot in zip(finished["kind"], finished["ttft_ms"], finished["tpot_ms"])
            if ttft <= slo_ttft_ms and (tpot or 0.0) <= slo_tpot_ms]
    return {"request_goodput": len(good) / run["window_s"], "decode_goodput": good.count(DECODE) / run["window_s"],
            "long_goodput": good.count(LONG) / run["window_s"]}


def apply_slo(result: dict, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """Recompute every run's goodput of a saved result at this SLO (in place)."""
    result["config"].update(slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
    for arm in result["arms"]:
        for run in arm["runs"]:
            run.update(goodput_at(run, slo_ttft_ms, slo_tpot_ms))
    return result


# ---- the whole benchmark --------------------------------------------------------------

def run_arm(arm: Arm, cfg: DisaggConfig, vocab: Vocabulary, log_dir: str) -> dict:
    from bench.serve.client import GrpcGenerateBackend, run_benchmark
    from common.cli.up import LocalStack
    print(f"\n== {arm.name}: {arm.description}\n   LocalStack({arm.num_prefill} prefill, 1 decode) "
          f"{' '.join(arm.passthrough)}; CPUs {({r: sorted(c) for r, c in arm.cpu_affinity.items()})}",
          flush=True)
    started = time.monotonic()
    result = {"arm": arm.name, "description": arm.description, "passthrough": list(arm.passthrough),
              "cpu_affinity": {role: sorted(cpus) for role, cpus in arm.cpu_affinity.items()}, "runs": []}
    with LocalStack(arm.num_prefill, 1, passthrough=list(arm.passthrough), log_dir=log_dir,
                    cpu_affinity={role: set(cpus) for role, cpus in arm.cpu_affinity.items()}) as stack:
        result["process_cpus"] = {name: sorted(os.sched_getaffinity(p.process.pid))
                                  for name, p in [("gateway", stack.gateway), *stack.instances.items()]}
        print(f"   stack up in {time.monotonic() - started:.0f}s; process CPUs {result['process_cpus']}",
              flush=True)

        async def drive() -> list[dict]:
            runs = []
            async with GrpcGenerateBackend(stack.address, request_id_prefix=f"disagg-{arm.name}") as backend:
                # One long and one short request first: the first forward passes of a process are slow.
                rng = np.random.default_rng([cfg.seed, 3])
                warmup = [*ranged_requests(1, vocab, rng, (cfg.long_input_range[0],) * 2, (4, 4), LONG),
                          *ranged_requests(1, vocab, rng, cfg.decode_input_range, (8, 8), DECODE)]
                warm, _ = await run_benchmark(backend, warmup, float("inf"))
                if not all(o.success for o in warm):
                    raise RuntimeError(f"warm-up failed: {[o.error for o in warm]}")
                decode_requests = decode_request_stream(cfg, vocab, cfg.seed)
                for rate_index, rate in enumerate(cfg.rates):
                    prompts = long_requests(cfg, vocab, rate_index, rate)
                    print(f"   rate {rate:g} long prompts/s: {len(prompts)} long prompts among "
                          f"{cfg.num_decode_streams} decode streams", flush=True)
                    run = await run_mixed(backend, decode_requests, prompts, rate, cfg.num_decode_streams,
                                          cfg.seed + rate_index, cfg.max_window_s)
                    figures = window_metrics(run, cfg.slo_ttft_ms, cfg.slo_tpot_ms)
                    runs.append({"rate": rate, **figures})
                    print("   " + format_run(arm.name, runs[-1]), flush=True)
                    await asyncio.to_thread(_wait_idle, stack)
            return runs

        result["runs"] = asyncio.run(drive())
    return result


def _wait_idle(stack, timeout_s: float = 120.0) -> None:
    """Cancelled decode streams are aborted asynchronously: let the next run start clean."""
    from bench.routing import wait_idle
    wait_idle(stack, timeout_s)


def format_run(arm: str, run: dict) -> str:
    def ms(key):
        return "-" if run.get(key) is None else f"{run[key]:.0f}"
    return (f"{arm} @ {run['rate']:g}/s: ITL p50 {ms('median_itl_ms')} p99 {ms('p99_itl_ms')} p99.9 "
            f"{ms('p99.9_itl_ms')} max {ms('max_itl_ms')} ms; TPOT p99 {ms('p99_tpot_ms')} ms; TTFT long "
            f"p50 {ms('long_median_ttft_ms')} decode p50 {ms('decode_median_ttft_ms')} ms; "
            f"{run['output_throughput']:.1f} out tok/s; goodput {run['request_goodput']:.3f} req/s; "
            f"long {run['long_completed']}/{run['num_long']}, decode finished {run['decode_finished']}, "
            f"window {run['window_s']:.0f}s{' (timed out)' if run['timed_out'] else ''}")


def run(cfg: DisaggConfig, log_dir: str) -> dict:
    from bench.routing import model_vocabulary
    from bench.fakes.fake_generate import measure_client_capacity
    cfg.check()
    cpus = usable_cpus()
    arms = make_arms(cfg, cpus)
    vocab = model_vocabulary(None)
    print("client self-check (in-process fake GenerateService) ...", flush=True)
    self_check = asyncio.run(measure_client_capacity(64, 256, 32))
    print(f"   {self_check['client_tokens_per_s']:.0f} streamed tokens/s over wall time, "
          f"{self_check['tokens_per_cpu_s']:.0f} per CPU-second", flush=True)
    results = [run_arm(arm, cfg, vocab, log_dir) for arm in arms]
    peak = max((r["output_throughput"] for arm in results for r in arm["runs"]), default=0.0)
    return {"config": asdict(cfg) | {"cpus": list(cpus), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                     "cpu_count": os.cpu_count()},
            "client_self_check": self_check,
            "client_headroom": {"stack_peak_output_tokens_per_s": peak,
                                "client_over_stack_wall": self_check["client_tokens_per_s"] / peak if peak else None,
                                "client_over_stack_cpu": self_check["tokens_per_cpu_s"] / peak if peak else None},
            "arms": results}


def format_table(result: dict) -> str:
    header = (f"{'arm':<19}{'rate/s':>7}{'ITL p50':>9}{'p99':>8}{'p99.9':>8}{'max':>8}{'TPOT p99':>10}"
              f"{'TTFT long p50':>15}{'decode p50':>12}{'out tok/s':>10}{'goodput':>9}")
    lines = [header]
    for arm in result["arms"]:
        for run in arm["runs"]:
            def ms(key):
                return "-" if run.get(key) is None else f"{run[key]:.0f}"
            lines.append(f"{arm['arm']:<19}{run['rate']:>7g}{ms('median_itl_ms'):>9}{ms('p99_itl_ms'):>8}"
                         f"{ms('p99.9_itl_ms'):>8}{ms('max_itl_ms'):>8}{ms('p99_tpot_ms'):>10}"
                         f"{ms('long_median_ttft_ms'):>15}{ms('decode_median_ttft_ms'):>12}"
                         f"{run['output_throughput']:>10.1f}{run['request_goodput']:>9.3f}")
    headroom = result["client_headroom"]
    if headroom["client_over_stack_wall"]:
        lines.append(f"client self-check: {result['client_self_check']['client_tokens_per_s']:.0f} tokens/s wall, "
                     f"{result['client_self_check']['tokens_per_cpu_s']:.0f} per CPU-s = "
                     f"{headroom['client_over_stack_wall']:.0f}x / {headroom['client_over_stack_cpu']:.0f}x the "
                     f"fastest arm's {headroom['stack_peak_output_tokens_per_s']:.1f} output tokens/s (target 10x)")
    return "\n".join(lines)


def write_plots(result: dict, directory: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    from pathlib import Path

    import matplotlib.pyplot as plt
    import matplotlib.ticker

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rates = sorted({run["rate"] for arm in result["arms"] for run in arm["runs"]})
    written = []
    fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 3.6), squeeze=False, sharey=True)
    for ax, rate in zip(axes[0], rates):
        for arm in result["arms"]:
            for run in arm["runs"]:
                if run["rate"] == rate and run["itls_ms"]:
                    values = np.sort(np.asarray(run["itls_ms"]))
                    ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=arm["arm"])
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(f"{rate:g} long prompts/s")
        ax.set_xlabel("decode ITL (ms, log)")
        ax.grid(alpha=0.3, which="both")
        ax.axhline(0.99, color="grey", lw=0.6, ls=":")
    axes[0][0].set_ylabel("fraction of ITL samples")
    axes[0][0].legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    written.append(out / "disagg_itl_cdf.png")
    fig.savefig(written[-1], dpi=80)
    plt.close(fig)

    fig, (good_ax, itl_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    for arm in result["arms"]:
        runs = sorted(arm["runs"], key=lambda r: r["rate"])
        good_ax.plot([r["rate"] for r in runs], [r["request_goodput"] for r in runs], "o-", label=arm["arm"])
        itl_ax.plot([r["rate"] for r in runs], [r["p99_itl_ms"] for r in runs], "o-", label=arm["arm"])
    cfg = result["config"]
    good_ax.set_title(f"goodput (TTFT <= {cfg['slo_ttft_ms'] / 1000:g} s, TPOT <= {cfg['slo_tpot_ms']:g} ms)")
    good_ax.set_ylabel("requests/s")
    itl_ax.set_title("decode p99 ITL")
    itl_ax.set_ylabel("ms")
    for ax in (good_ax, itl_ax):
        ax.set_xlabel("long prompts/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    written.append(out / "disagg_goodput_vs_rate.png")
    fig.savefig(written[-1], dpi=80)
    plt.close(fig)
    return [str(p) for p in written]


def build_parser() -> argparse.ArgumentParser:
    d = DisaggConfig()
    parser = EnvDefaultsParser(prog="pdserve bench disagg", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default=",".join(d.arms), help="comma list, run in this order")
    parser.add_argument("--rates", default=",".join(f"{r:g}" for r in d.rates),
                        help="long prompts per second, comma list (the sweep)")
    parser.add_argument("--long-duration", type=float, default=d.long_duration_s,
                        help="seconds of long-prompt arrivals per rate")
    parser.add_argument("--max-window", type=float, default=d.max_window_s,
                        help="seconds a rate's window may last before what is left is cancelled")
    parser.add_argument("--decode-streams", type=int, default=d.num_decode_streams)
    parser.add_argument("--decode-input-len", type=parse_length_range, default=d.decode_input_range)
    parser.add_argument("--decode-output-len", type=parse_length_range, default=d.decode_output_range)
    parser.add_argument("--long-input-len", type=parse_length_range, default=d.long_input_range)
    parser.add_argument("--long-output-len", type=int, default=d.long_output_len)
    parser.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens,
                        help="colocated-chunked: per-step token budget")
    parser.add_argument("--kv-cache-memory", default=d.kv_cache_memory, help="every engine's KV pool")
    parser.add_argument("--slo-ttft-ms", type=float, default=d.slo_ttft_ms)
    parser.add_argument("--slo-tpot-ms", type=float, default=d.slo_tpot_ms)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--json", default=None, metavar="FILE")
    parser.add_argument("--plot", default=None, metavar="DIR", help="PNG charts (needs matplotlib)")
    parser.add_argument("--log-dir", default=None, help="the stacks' logs; default: a temporary directory")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="run nothing: reread a saved result, recompute goodput at --slo-ttft-ms / "
                             "--slo-tpot-ms, print the table and write --json / --plot")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = DisaggConfig(arms=tuple(a.strip() for a in args.arms.split(",") if a.strip()),
                           rates=tuple(parse_rates(args.rates)), long_duration_s=args.long_duration,
                           max_window_s=args.max_window, num_decode_streams=args.decode_streams,
                           decode_input_range=args.decode_input_len, decode_output_range=args.decode_output_len,
                           long_input_range=args.long_input_len, long_output_len=args.long_output_len,
                           chunk_tokens=args.chunk_tokens, kv_cache_memory=args.kv_cache_memory,
                           slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, seed=args.seed)
        cfg.check()
        usable_cpus()
        if args.plot:
            import importlib.util
            if importlib.util.find_spec("matplotlib") is None:
                raise ValueError("--plot needs matplotlib: pip install 'pdserve[bench]' (matplotlib==3.11.2)")
    except ValueError as e:
        print(f"pdserve bench disagg: error: {e}", file=sys.stderr)
        return 2
    if args.from_json:
        try:
            with open(args.from_json) as f:
                result = apply_slo(json.load(f), args.slo_ttft_ms, args.slo_tpot_ms)
        except (OSError, ValueError, KeyError) as e:
            print(f"pdserve bench disagg: error: cannot reread {args.from_json}: {e}", file=sys.stderr)
            return 2
    else:
        with tempfile.TemporaryDirectory(prefix="bench-disagg-") as tmp:
            log_dir = args.log_dir or tmp
            print(f"stack logs in {log_dir}", flush=True)
            result = run(cfg, log_dir)
    print("\n" + format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        for path in write_plots(result, args.plot):
            print(f"wrote {path}")
    failed = any(r["long_failed"] or r["decode_failed"] for arm in result["arms"] for r in arm["runs"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
