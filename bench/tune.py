"""`pdserve tune`: the engine settings with the best throughput within latency limits.

    pdserve tune --role colocated --num-requests 24 --input-len 64-192 --output-len 16-48 \\
        --max-num-seqs 4,8,16,32 --max-num-batched-tokens 128,512,2048 \\
        --kv-cache-memory 8MiB,32MiB,256MiB --ttft-ms 20000 --tpot-ms 400 \\
        --json tune.json --plot tune.png --env-out tune.env
    pdserve tune ... --search exhaustive          # measure every point of the grid

vLLM's auto_tune idea for one role on this machine: run the engine in this process
over a grid of `max_num_seqs` x `max_num_batched_tokens` x KV pool size (x `--dtype`,
where more than one is given) on one seeded workload (input and output lengths uniform
on LOW-HIGH, arrivals at --request-rate, `inf` = all at once), and report the setting
with the best throughput whose TTFT and TPOT at --percentile stay within the limits,
with the whole table, a plot and a `deploy/pdserve.env` fragment.

Roles: `colocated` (the engine prefills and decodes; throughput = output tokens/s),
`prefill` (max_tokens 1; TTFT only; throughput = prompt tokens/s), `decode` (each
request joins with its prompt's KV already in place, as a decode instance's imports
do, so only decode steps run; output tokens/s).

Every run stops as soon as its outcome is known:
- a setting whose KV pool cannot hold one request of the workload (the engine's
  KV-capacity error at start, max_model_len = longest input + output) is not run,
  and neither is any smaller pool;
- a run stops once enough requests are over a limit that the percentile must be
  (TTFT: requests past the limit without a first token count too; TPOT: a request's
  time since its first token over its tokens so far is a lower bound of its TPOT);
- `--search adaptive` (the default) also stops a run once it cannot beat the best
  throughput seen (tokens of the workload / time so far < best), and walks the grid by
  coordinate ascent: from the largest setting, try every value of one setting with
  the others fixed, move to the best, next setting, until a whole pass moves nothing;
  along max_num_seqs, a value that broke the TPOT limit rules out every larger one and
  one that broke the TTFT limit every smaller one; `--confirm N` then runs the N best
  once more and chooses by the mean of the two runs.
- `--clock cpu` measures on this process's CPU clock (plus idle waits for arrivals)
  instead of the wall clock: on a machine shared with other work (this project's CI)
  wall-clock runs of a few seconds vary 2x with the others' load.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from bench.plan import LengthRange, Traffic, make_requests
from bench.plan_sim import SimRequest
from bench.profile import cpu_model_name, now_iso, versions
from common.engine.config import parse_memory_size

ROLES = ("colocated", "prefill", "decode")
# Outcomes of one setting. "ok": measured to the end; the rest were stopped early.
OK, CANNOT_START, TTFT_LIMIT, TPOT_LIMIT, DOMINATED, PRUNED = (
    "ok", "cannot start", "TTFT over limit", "TPOT over limit", "cannot beat best", "pruned")


@dataclass(frozen=True, order=True)
class Setting:
    dtype: str
    kv_cache_memory: str
    max_num_batched_tokens: int
    max_num_seqs: int

    def label(self) -> str:
        return (f"seqs={self.max_num_seqs} tokens={self.max_num_batched_tokens} kv={self.kv_cache_memory}"
                f" dtype={self.dtype}")

    def env_fragment(self) -> str:
        return (f"PDSERVE_MAX_NUM_SEQS={self.max_num_seqs}\n"
                f"PDSERVE_MAX_NUM_BATCHED_TOKENS={self.max_num_batched_tokens}\n"
                f"PDSERVE_KV_CACHE_MEMORY={self.kv_cache_memory}\nPDSERVE_DTYPE={self.dtype}\n")


@dataclass(frozen=True)
class Grid:
    max_num_seqs: tuple[int, ...]
    max_num_batched_tokens: tuple[int, ...]
    kv_cache_memory: tuple[str, ...]  # as given; sorted by size
    dtype: tuple[str, ...] = ("float32",)

    # The axes coordinate ascent walks, in order.
    AXES = ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "dtype")

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_memory", tuple(sorted(self.kv_cache_memory, key=parse_memory_size)))
        object.__setattr__(self, "max_num_seqs", tuple(sorted(self.max_num_seqs)))
        object.__setattr__(self, "max_num_batched_tokens", tuple(sorted(self.max_num_batched_tokens)))

    def settings(self) -> list[Setting]:
        return [Setting(d, kv, t, s) for d in self.dtype for kv in self.kv_cache_memory
                for t in self.max_num_batched_tokens for s in self.max_num_seqs]

    def __len__(self) -> int:
        return len(self.max_num_seqs) * len(self.max_num_batched_tokens) * len(self.kv_cache_memory) * len(self.dtype)

    def largest(self) -> Setting:
        """Where the walk starts: the most sequences, tokens and KV, as vLLM's auto_tune
        does. Throughput grows with batch and budget until a limit cuts it, so this
        corner is the likeliest best, and a fast first incumbent makes every later run
        that cannot beat it stop early. (From the middle, coordinate ascent missed a best
        that needs two axes raised together: more sequences broke TPOT at a small token
        budget but not at a large one.)"""
        return Setting(self.dtype[0], self.kv_cache_memory[-1], self.max_num_batched_tokens[-1],
                       self.max_num_seqs[-1])


@dataclass(frozen=True)
class Limits:
    ttft_ms: float
    tpot_ms: float
    percentile: float = 90.0

    def num_over_to_miss(self, num_requests: int) -> int:
        """How many of num_requests over a limit make its percentile (numpy's linear
        interpolation) exceed it: the value at index floor((N-1) p / 100) is then over."""
        return num_requests - math.floor((num_requests - 1) * self.percentile / 100)


@dataclass
class Measurement:
    setting: Setting
    status: str
    throughput: float = 0.0  # tokens/s (output; prompt for the prefill role); 0 unless measured to the end
    ttft_ms: float | None = None  # at the percentile
    tpot_ms: float | None = None
    seconds: float = 0.0  # wall time this setting cost
    detail: str = ""

    def feasible(self) -> bool:
        return self.status == OK

    def row(self) -> dict:
        return {**dataclasses.asdict(self.setting), "status": self.status, "throughput": round(self.throughput, 2),
                "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "seconds": round(self.seconds, 2),
                "detail": self.detail}


class WallClock:
    """Seconds since start; waiting for an arrival sleeps."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def wait_until(self, when_s: float) -> None:
        time.sleep(max(0.0, when_s - self.now()))


class CpuClock:
    """This process's CPU seconds since start, plus the idle time waited for arrivals:
    the time an engine would see with its cores to itself. On a machine shared with
    other work, wall-clock runs of a few seconds vary by 2x with the others' load
    (docs/benchmarks.md, "pdserve tune"); the CPU clock does not see that load.
    Meaningful with --threads 1 (one engine thread: CPU time = its busy time)."""

    def __init__(self) -> None:
        self.origin = time.process_time()
        self.idle_s = 0.0

    def now(self) -> float:
        return time.process_time() - self.origin + self.idle_s

    def wait_until(self, when_s: float) -> None:
        self.idle_s += max(0.0, when_s - self.now())


CLOCKS = {"wall": WallClock, "cpu": CpuClock}


class StopRun(Exception):
    def __init__(self, status: str, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


@dataclass
class RequestTimes:
    arrival_s: float
    output_len: int
    first_s: float | None = None
    last_s: float | None = None
    num_tokens: int = 0


class EngineBench:
    """Runs the workload on one engine per setting; the model is loaded once per dtype
    (EngineCore takes an existing executor and allocates a fresh KV pool in it)."""

    def __init__(self, model: str | None, role: str, requests: list[SimRequest], limits: Limits,
                 max_model_len: int, clock: str = "wall"):
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
        self.model, self.role, self.requests, self.limits = model, role, requests, limits
        self.max_model_len = max_model_len
        self.clock = CLOCKS[clock]
        self.executors: dict[str, object] = {}
        self.num_runs = 0
        self.total_tokens = sum(len(r.prompt_ids) if role == "prefill" else r.output_len for r in requests)

    def _engine(self, setting: Setting):
        from common.engine.config import ModelConfig, make_engine_config
        from common.engine.engine_core import EngineCore
        from common.engine.executor import InProcessExecutor
        from common.engine.model_files import load_hf_config, resolve_model
        config = make_engine_config(self.model, dtype=setting.dtype, kv_cache_memory=setting.kv_cache_memory,
                                    max_num_seqs=setting.max_num_seqs,
                                    max_num_batched_tokens=setting.max_num_batched_tokens,
                                    max_model_len=self.max_model_len)
        if setting.dtype not in self.executors:
            model_dir = resolve_model(self.model)
            self.executors[setting.dtype] = InProcessExecutor(ModelConfig.from_hf_config(load_hf_config(model_dir)),
                                                              model_dir, config)
        return EngineCore(config, executor=self.executors[setting.dtype])

    def measure(self, setting: Setting, beat_throughput: float = 0.0) -> Measurement:
        """One run; stops early on a limit, or (beat_throughput > 0) once it cannot beat it."""
        cost = self.clock()
        try:
            engine = self._engine(setting)
        except ValueError as e:  # the KV-capacity error (or another setting the engine refuses)
            return Measurement(setting, CANNOT_START, seconds=cost.now(), detail=str(e))
        try:
            times = self._run(engine, beat_throughput)
        except StopRun as stop:
            return Measurement(setting, stop.status, seconds=cost.now(), detail=stop.detail)
        finally:
            engine.abort_all()
        duration = max(t.last_s for t in times)
        ttft = self._percentile([t.first_s - t.arrival_s for t in times])
        tpot = self._percentile([(t.last_s - t.first_s) / (t.num_tokens - 1) for t in times if t.num_tokens > 1])
        # Early stops catch only certain misses; the final percentiles decide the rest.
        status = (TTFT_LIMIT if ttft is not None and ttft > self.limits.ttft_ms else
                  TPOT_LIMIT if tpot is not None and tpot > self.limits.tpot_ms else OK)
        return Measurement(setting, status, self.total_tokens / duration, ttft, tpot, cost.now(),
                           "" if status == OK else "measured to the end")

    def _percentile(self, values_s: list[float]) -> float | None:
        import numpy as np
        return round(float(np.percentile(values_s, self.limits.percentile)) * 1000, 2) if values_s else None

    def _run(self, engine, beat_throughput: float) -> list[RequestTimes]:
        from common.engine.request import Request
        from common.engine.sampling_params import SamplingParams
        self.num_runs += 1
        run = self.num_runs
        times = {f"{run}-{r.req_id}": RequestTimes(r.arrival_s, 1 if self.role == "prefill" else r.output_len)
                 for r in self.requests}
        to_arrive = deque(sorted(((r.arrival_s, f"{run}-{r.req_id}", r) for r in self.requests), key=lambda x: x[0]))
        to_admit: deque[Request] = deque()  # decode role: waiting for a seat and blocks
        unfinished = set(times)
        clock = self.clock()
        while unfinished:
            now = clock.now()
            while to_arrive and to_arrive[0][0] <= now:
                _, req_id, r = to_arrive.popleft()
                max_tokens = 1 if self.role == "prefill" else r.output_len
                request = Request(req_id, r.prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                        ignore_eos=True))
                if self.role == "decode":
                    to_admit.append(request)
                else:
                    engine.add_request(request)
            outputs = []
            while to_admit and engine.reserve_remote_kv(to_admit[0]) is not None:
                # The prompt's KV is "already here" (its values do not change a step's cost).
                outputs += engine.scheduler.finish_remote_kv(to_admit.popleft().req_id, [1000])
            if not engine.has_unfinished_requests() and not outputs:
                if not to_arrive:
                    raise RuntimeError(f"{len(unfinished)} requests neither running nor to arrive")
                clock.wait_until(to_arrive[0][0])  # idle until the next scheduled arrival
                continue
            outputs += engine.step()
            now = clock.now()
            for out in outputs:
                t = times[out.req_id]
                if t.first_s is None:
                    t.first_s = now
                t.last_s = now
                t.num_tokens += len(out.new_token_ids)
                if out.finished:
                    unfinished.discard(out.req_id)
            self._check(times.values(), now, beat_throughput)
        return list(times.values())

    def _check(self, times, now: float, beat_throughput: float) -> None:
        limits = self.limits
        to_miss = limits.num_over_to_miss(len(self.requests))
        ttft_over = sum(1 for t in times if now >= t.arrival_s and
                        ((t.first_s if t.first_s is not None else now) - t.arrival_s) * 1000 > limits.ttft_ms)
        if ttft_over >= to_miss:
            raise StopRun(TTFT_LIMIT, f"{ttft_over} requests over {limits.ttft_ms:g} ms TTFT after {now:.1f} s")
        if self.role != "prefill":
            # An unfinished request's last token is still to come, so (now - first) / (n - 1)
            # is a lower bound of its TPOT; a finished one's is exact.
            tpot_over = sum(1 for t in times if t.first_s is not None and t.output_len > 1 and
                            ((t.last_s if t.num_tokens >= t.output_len else now) - t.first_s)
                            / (t.output_len - 1) * 1000 > limits.tpot_ms)
            if tpot_over >= to_miss:
                raise StopRun(TPOT_LIMIT, f"{tpot_over} requests over {limits.tpot_ms:g} ms TPOT after {now:.1f} s")
        if beat_throughput > 0 and now > 0 and self.total_tokens / now < beat_throughput:
            raise StopRun(DOMINATED, f"{self.total_tokens / now:.1f} tokens/s at best after {now:.1f} s")


@dataclass
class TuneResult:
    search: str
    measurements: list[Measurement]
    seconds: float  # wall clock
    best: Measurement | None = None
    num_grid_points: int = 0
    extra: dict = field(default_factory=dict)


def best_of(measurements: list[Measurement]) -> Measurement | None:
    return max((m for m in measurements if m.feasible()), key=lambda m: m.throughput, default=None)


def exhaustive(bench: EngineBench, grid: Grid, progress: bool = True) -> TuneResult:
    started = time.perf_counter()
    measurements = []
    with tqdm(total=len(grid), desc="tune (exhaustive)", disable=not progress) as bar:
        for setting in grid.settings():
            measurements.append(bench.measure(setting))
            bar.set_postfix_str(_describe(measurements[-1]))
            bar.update()
    return TuneResult("exhaustive", measurements, time.perf_counter() - started, best_of(measurements), len(grid),
                      {"measured_seconds": sum(m.seconds for m in measurements)})


def adaptive(bench: EngineBench, grid: Grid, progress: bool = True, confirm: int = 0) -> TuneResult:
    """Coordinate ascent (module doc); then the `confirm` best settings are run once
    more and the choice goes by the mean of both runs, so one lucky run on a noisy
    machine does not decide it."""
    started = time.perf_counter()
    results: dict[Setting, Measurement] = {}
    smallest_startable_kv: dict[str, int] = {}  # dtype -> index into grid.kv_cache_memory
    bar = tqdm(total=len(grid), desc="tune (adaptive)", disable=not progress)

    def evaluate(setting: Setting) -> Measurement:
        if setting in results:
            return results[setting]
        kv_index = grid.kv_cache_memory.index(setting.kv_cache_memory)
        if kv_index < smallest_startable_kv.get(setting.dtype, -1):
            m = Measurement(setting, CANNOT_START, detail="a larger KV pool could not start")
        else:
            best = best_of(list(results.values()))
            m = bench.measure(setting, best.throughput if best else 0.0)
            if m.status == CANNOT_START:
                # Every smaller pool fails alike: remember the boundary.
                smallest_startable_kv[setting.dtype] = max(smallest_startable_kv.get(setting.dtype, -1), kv_index + 1)
        results[setting] = m
        bar.set_postfix_str(_describe(m))
        bar.update()
        return m

    # Walking away from the current value along an axis, an outcome that can only get
    # worse further out ends the walk in that direction: more sequences only lengthen
    # decode steps (TPOT), fewer only lengthen the wait for a seat (TTFT), a smaller KV
    # pool cannot start where a larger one could not.
    stops_walk = {("max_num_seqs", +1): TPOT_LIMIT, ("max_num_seqs", -1): TTFT_LIMIT,
                  ("kv_cache_memory", -1): CANNOT_START}

    def prune(setting: Setting, reason: str) -> None:
        if setting not in results:
            results[setting] = Measurement(setting, PRUNED, detail=reason)
            bar.update()

    current = grid.largest()
    evaluate(current)
    moved = True
    while moved:
        moved = False
        for axis in Grid.AXES:
            values = getattr(grid, axis)
            if len(values) == 1:
                continue
            here = values.index(getattr(current, axis))
            for direction, walk in ((+1, values[here + 1:]), (-1, values[:here][::-1])):
                stopped_by = None
                for value in walk:
                    candidate = dataclasses.replace(current, **{axis: value})
                    if stopped_by is not None:
                        prune(candidate, stopped_by)
                        continue
                    m = evaluate(candidate)
                    if m.status == stops_walk.get((axis, direction)):
                        stopped_by = f"{axis}={value} gave {m.status}"
            best = best_of(list(results.values()))
            if best is not None and best.setting != current:
                current, moved = best.setting, True
    finalists = sorted((m for m in results.values() if m.feasible()), key=lambda m: -m.throughput)[:confirm]
    for m in finalists:
        again = bench.measure(m.setting)
        m.seconds += again.seconds
        m.detail = f"runs: {m.throughput:.2f} and {again.throughput:.2f} tokens/s ({again.status}); mean"
        if again.feasible():
            m.throughput = (m.throughput + again.throughput) / 2
        else:  # over a limit in one of two runs: not a safe choice
            m.status, m.throughput = again.status, (m.throughput + again.throughput) / 2
    bar.close()
    measurements = list(results.values())
    return TuneResult("adaptive", measurements, time.perf_counter() - started, best_of(measurements), len(grid),
                      {"measured_seconds": sum(m.seconds for m in measurements)})


def _describe(m: Measurement) -> str:
    return f"{m.setting.label()}: {m.status}" + (f" {m.throughput:.1f} tok/s" if m.feasible() else "")


# ---- output -------------------------------------------------------------------------------


def format_table(result: TuneResult) -> str:
    lines = [f"{'max_num_seqs':>12} {'batched_tokens':>14} {'kv':>8} {'dtype':>9} {'tokens/s':>9} "
             f"{'TTFT ms':>9} {'TPOT ms':>8} {'run s':>6}  status"]
    for m in sorted(result.measurements, key=lambda m: m.setting):
        s = m.setting
        mark = "  <- best" if result.best is not None and m is result.best else ""
        lines.append(f"{s.max_num_seqs:>12} {s.max_num_batched_tokens:>14} {s.kv_cache_memory:>8} {s.dtype:>9} "
                     f"{m.throughput:>9.1f} {_num(m.ttft_ms):>9} {_num(m.tpot_ms):>8} {m.seconds:>6.1f}  "
                     f"{m.status}{mark}")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def write_plot(result: TuneResult, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict[tuple, list[Measurement]] = {}
    for m in result.measurements:
        if m.feasible():
            key = (m.setting.max_num_batched_tokens, m.setting.kv_cache_memory, m.setting.dtype)
            lines.setdefault(key, []).append(m)
    for (tokens, kv, dtype), ms in sorted(lines.items()):
        ms.sort(key=lambda m: m.setting.max_num_seqs)
        ax.plot([m.setting.max_num_seqs for m in ms], [m.throughput for m in ms], marker="o",
                label=f"tokens={tokens} kv={kv} {dtype}")
    if result.best is not None:
        ax.plot([result.best.setting.max_num_seqs], [result.best.throughput], marker="*", markersize=16,
                color="black", linestyle="none", label="best within limits")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max_num_seqs")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"pdserve tune ({result.search}): settings within the latency limits")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def env_fragment(result: TuneResult, role: str, workload: str) -> str:
    m = result.best
    return (f"# pdserve tune ({result.search}, {now_iso()}): role {role}, {workload}, on {cpu_model_name()};\n"
            f"# {m.throughput:.1f} tokens/s, TTFT p{result.extra.get('percentile', 90):g} {m.ttft_ms} ms, "
            f"TPOT {m.tpot_ms} ms. Merge into deploy/pdserve.env.\n" + m.setting.env_fragment())


def str_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(item) for item in str_list(text))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=ROLES, default="colocated")
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="wall, or cpu: this process's CPU time (+ idle waits), for machines shared with "
                             "other work; use with --threads 1")
    work = parser.add_argument_group("workload")
    work.add_argument("--num-requests", type=int, default=24)
    work.add_argument("--input-len", default="64-192", help="LOW-HIGH prompt tokens, uniform")
    work.add_argument("--output-len", default="16-48", help="LOW-HIGH output tokens, uniform")
    work.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf: all at once")
    work.add_argument("--seed", type=int, default=0)
    grid = parser.add_argument_group("grid (comma lists)")
    grid.add_argument("--max-num-seqs", type=int_list, default=(4, 8, 16, 32))
    grid.add_argument("--max-num-batched-tokens", type=int_list, default=(128, 512, 2048))
    grid.add_argument("--kv-cache-memory", type=str_list, default=("8MiB", "32MiB", "256MiB"))
    grid.add_argument("--dtype", type=str_list, default=("float32",), help="e.g. float32,bfloat16")
    limits = parser.add_argument_group("latency limits")
    limits.add_argument("--ttft-ms", type=float, required=True)
    limits.add_argument("--tpot-ms", type=float, default=math.inf)
    limits.add_argument("--percentile", type=float, default=90.0)
    parser.add_argument("--search", choices=("adaptive", "exhaustive", "both"), default="adaptive",
                        help="both: adaptive, then the whole grid, and compare "
                             "(how docs/benchmarks.md's figures were made)")
    parser.add_argument("--confirm", type=int, default=0,
                        help="adaptive: run the best N settings once more and choose by the mean")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="PNG of throughput per setting (needs matplotlib)")
    parser.add_argument("--env-out", default=None, help="write the best setting as a deploy/pdserve.env fragment")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    try:
        input_len, output_len = LengthRange.parse(args.input_len), LengthRange.parse(args.output_len)
        traffic = Traffic(request_rate=1.0, input_len=input_len, output_len=output_len)  # lengths only
        grid = Grid(args.max_num_seqs, args.max_num_batched_tokens, args.kv_cache_memory, args.dtype)
    except ValueError as e:
        print(f"pdserve tune: error: {e}", file=sys.stderr)
        return 2
    requests = make_requests(traffic, args.num_requests, args.seed)
    if math.isfinite(args.request_rate):
        from bench.serve.arrivals import send_offsets
        for request, offset in zip(requests, send_offsets(len(requests), args.request_rate, 1.0, args.seed)):
            request.arrival_s = float(offset)
    else:
        for request in requests:
            request.arrival_s = 0.0
    limits = Limits(args.ttft_ms, args.tpot_ms, args.percentile)
    bench = EngineBench(args.model, args.role, requests, limits, input_len.high + output_len.high, args.clock)
    bench.measure(grid.largest())  # warm-up: loads the model and pays first-call costs outside any timing
    results = []
    for search in (("adaptive", "exhaustive") if args.search == "both" else (args.search,)):
        result = (adaptive(bench, grid, not args.no_progress, args.confirm) if search == "adaptive"
                  else exhaustive(bench, grid, not args.no_progress))
        result.extra["percentile"] = args.percentile
        result.extra["clock"] = args.clock
        results.append(result)
        print(f"\n{search}: {len(result.measurements)} of {len(grid)} settings tried in {result.seconds:.1f} s wall, "
              f"{result.extra['measured_seconds']:.1f} s on the {args.clock} clock")
        print(format_table(result))
    workload = (f"{args.num_requests} requests, input {args.input_len}, output {args.output_len} tokens, "
                f"rate {args.request_rate:g}/s")
    summary = {"role": args.role, "workload": workload, "limits": dataclasses.asdict(limits),
               "cpu": cpu_model_name(), "versions": versions().model_dump(), "created": now_iso(),
               "clock": args.clock,
               "runs": [{"search": r.search, "seconds": round(r.seconds, 1),
                         "measured_seconds": round(r.extra["measured_seconds"], 1),
                         "num_grid_points": r.num_grid_points,
                         "best": r.best.row() if r.best else None, "table": [m.row() for m in r.measurements]}
                        for r in results]}
    if len(results) == 2 and all(r.best for r in results):
        tuned, full = results
        in_full = {m.setting: m for m in full.measurements}[tuned.best.setting]
        summary["comparison"] = {
            "time_ratio": round(tuned.seconds / full.seconds, 3),
            "measured_time_ratio": round(tuned.extra["measured_seconds"] / full.extra["measured_seconds"], 3),
            "tuned_setting_in_grid_run_vs_grid_best": round(in_full.throughput / full.best.throughput, 3),
            "tuned_run_vs_grid_best": round(tuned.best.throughput / full.best.throughput, 3)}
        print(f"\nadaptive took {summary['comparison']['time_ratio']:.0%} of the grid's wall time "
              f"({summary['comparison']['measured_time_ratio']:.0%} on the {args.clock} clock); its choice measured "
              f"{summary['comparison']['tuned_setting_in_grid_run_vs_grid_best']:.1%} of the grid's best in the "
              "grid run")
    final = results[0]
    if final.best is None:
        print("no setting met the limits")
    else:
        print(f"\nbest within limits: {final.best.setting.label()}: {final.best.throughput:.1f} tokens/s")
        if args.env_out:
            Path(args.env_out).write_text(env_fragment(final, args.role, workload))
            print(f"wrote {args.env_out}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(final, args.plot)
        print(f"wrote {args.plot}")
    return 0 if final.best else 1


if __name__ == "__main__":
    sys.exit(main())
