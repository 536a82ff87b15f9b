"""`pdserve profile`: how long the engine's steps take on this machine, as a JSON file.

    pdserve profile --out docs/bench/profile-cpu1.json              # bundled model, 1 thread
    pdserve profile --out p.json --threads 2 --batch-sizes 1,8,32

One instance of either role is one engine: a prefill instance runs prefill steps, a
decode instance decode steps, a colocated one both. For one engine configuration
(model, dtype, threads = the cores one instance gets) it records

- prefill: the time of one step that computes `n` new prompt tokens of one request
  whose first `k` tokens are already in the prefix cache, over a grid of n and k;
- decode: the time of one step that decodes one token for each of `B` requests
  holding `C` tokens of context in all, over a grid of B and context per request;
- KV transfer: the time to move the KV of `t` tokens from one process to another
  over the ZeroMQ connector on loopback TCP (bench.transfer's sender and receiver;
  the bundled model's KV geometry), over a grid of t;

each the median of `--reps` repetitions, and least-squares fits that `pdserve plan`'s
simulation uses (bench.plan_sim):

    prefill step = a + b * tokens + c * attention,  attention = sum n * (k + n / 2) / 1000
    decode step  = a + b * batch  + c * context / 1000  (+ the samples' mean residual per
                   batch size, interpolated, within the measured batch sizes)
    transfer     = a + b * tokens

A step that mixes both (a colocated engine) is costed as the prefill step with the
decodes as that many more tokens (one forward pass over all rows), and at least the
decode step alone. The file
records the machine (CPU model, cores, threads) and the versions it came from.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

PROFILE_SCHEMA_VERSION = 1
ATTENTION_UNIT = 1000.0  # attention and context terms are per thousand tokens: coefficients stay readable


class Machine(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cpu_model: str
    num_cpus: int
    num_threads: int  # torch threads the measured engine ran with (one instance's cores)
    device: str = "cpu"
    hostname: str = ""


class Versions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pdserve: str
    git_commit: str = ""
    torch: str = ""
    python: str = ""


class LinearFit(BaseModel):
    """seconds = intercept_s + sum(coef * feature); features named per section."""
    model_config = ConfigDict(extra="forbid")
    intercept_s: float = Field(ge=0)
    coefficients: dict[str, float]
    r2: float | None = None

    def predict(self, **features: float) -> float:
        return self.intercept_s + sum(self.coefficients[name] * features[name] for name in self.coefficients)


class PrefillSample(BaseModel):
    num_new_tokens: int = Field(ge=1)
    num_cached_tokens: int = Field(ge=0)
    seconds: float = Field(gt=0)


class DecodeSample(BaseModel):
    batch_size: int = Field(ge=1)
    total_context_tokens: int = Field(ge=1)
    seconds: float = Field(gt=0)


class TransferSample(BaseModel):
    num_tokens: int = Field(ge=1)
    seconds: float = Field(gt=0)


class EngineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    dtype: str
    block_size: int = 16
    kv_bytes_per_token: int = Field(ge=1)


class Profile(BaseModel):
    """A machine's step times for one engine configuration (`pdserve profile`'s output)."""
    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[1] = PROFILE_SCHEMA_VERSION
    created: str = ""
    machine: Machine
    versions: Versions
    engine: EngineSettings
    prefill_samples: list[PrefillSample] = []
    decode_samples: list[DecodeSample] = []
    transfer_samples: list[TransferSample] = []
    prefill_fit: LinearFit  # features: tokens, attention
    decode_fit: LinearFit  # features: batch, context
    transfer_fit: LinearFit  # features: tokens
    _decode_residuals_cache: list[tuple[int, float]] | None = PrivateAttr(default=None)

    # ---- the step-time model the simulation and the analytic plan use ----------------

    def prefill_step_s(self, chunks: list[tuple[int, int]]) -> float:
        """One step computing these (new tokens, tokens before them) prompt chunks."""
        if not chunks:
            return 0.0
        return self.prefill_fit.predict(tokens=sum(n for n, _ in chunks),
                                        attention=sum(n * (k + n / 2) for n, k in chunks) / ATTENTION_UNIT)

    def decode_step_s(self, batch_size: int, total_context_tokens: int) -> float:
        """The fit, corrected by the samples within their range of batch sizes: CPU
        matmul kernels change with the number of rows (a GEMV for one, packed GEMMs
        for more), so the step time need not be linear in the batch (on the 2-core CI
        machine 2 sequences took ~350 ms a step against ~120 ms for 1 and ~160 ms for 8,
        in every round). Per measured batch size, the mean of what the fit leaves
        unexplained is added, interpolated linearly between batch sizes."""
        if batch_size <= 0:
            return 0.0
        fitted = self.decode_fit.predict(batch=batch_size, context=total_context_tokens / ATTENTION_UNIT)
        residuals = self._decode_residuals()
        if not residuals or not residuals[0][0] <= batch_size <= residuals[-1][0]:
            return fitted
        batches, values = zip(*residuals)
        return max(fitted + float(np.interp(batch_size, batches, values)), 0.0)

    def _decode_residuals(self) -> list[tuple[int, float]]:
        """[(batch size, mean of sample - fit)] sorted by batch size; cached."""
        cached = self._decode_residuals_cache
        if cached is None:
            by_batch: dict[int, list[float]] = {}
            for s in self.decode_samples:
                fit = self.decode_fit.predict(batch=s.batch_size, context=s.total_context_tokens / ATTENTION_UNIT)
                by_batch.setdefault(s.batch_size, []).append(s.seconds - fit)
            cached = sorted((b, float(np.mean(r))) for b, r in by_batch.items())
            self._decode_residuals_cache = cached
        return cached

    def mixed_step_s(self, chunks: list[tuple[int, int]], batch_size: int, total_context_tokens: int) -> float:
        """A step with prefill chunks and decodes (colocated). The runner puts every row
        of a step through one forward pass, so the decodes' rows cost what as many more
        prompt tokens cost (each reading its context in attention) rather than a decode
        step of their own, which is mostly reading the weights the prefill reads anyway;
        and a step never costs less than its decodes alone."""
        if not chunks:
            return self.decode_step_s(batch_size, total_context_tokens)
        if batch_size <= 0:
            return self.prefill_step_s(chunks)
        fit = self.prefill_fit
        with_decode_rows = self.prefill_step_s(chunks) + fit.coefficients.get("tokens", 0.0) * batch_size + \
            fit.coefficients.get("attention", 0.0) * total_context_tokens / ATTENTION_UNIT
        return max(with_decode_rows, self.decode_step_s(batch_size, total_context_tokens))

    def transfer_s(self, num_tokens: int) -> float:
        return self.transfer_fit.predict(tokens=num_tokens) if num_tokens > 0 else 0.0

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        return cls.model_validate_json(Path(path).read_text())

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=1))


# ---- fitting ---------------------------------------------------------------------------


def fit_linear(features: dict[str, list[float]], seconds: list[float]) -> LinearFit:
    """Least squares with an intercept; a negative coefficient (noise on a term that does
    not matter on this machine) is dropped and the rest refitted, so predictions never
    fall as work grows."""
    names = list(features)
    y = np.asarray(seconds, dtype=float)  # [num_samples]
    while True:
        # [num_samples, 1 + len(names)]
        x = np.column_stack([np.ones_like(y)] + [np.asarray(features[n], dtype=float) for n in names])
        solution, *_ = np.linalg.lstsq(x, y, rcond=None)
        negative = [n for n, c in zip(names, solution[1:]) if c < 0]
        if not negative:
            break
        names.remove(negative[0])
    intercept = max(float(solution[0]), 0.0)
    coefficients = {n: float(c) for n, c in zip(names, solution[1:])} | {n: 0.0 for n in features if n not in names}
    predicted = x @ solution
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - predicted) ** 2).sum()) / total if total > 0 else None
    return LinearFit(intercept_s=intercept, coefficients=coefficients, r2=r2)


def fit_prefill(samples: list[PrefillSample]) -> LinearFit:
    return fit_linear({"tokens": [s.num_new_tokens for s in samples],
                       "attention": [s.num_new_tokens * (s.num_cached_tokens + s.num_new_tokens / 2) / ATTENTION_UNIT
                                     for s in samples]},
                      [s.seconds for s in samples])


def fit_decode(samples: list[DecodeSample]) -> LinearFit:
    return fit_linear({"batch": [s.batch_size for s in samples],
                       "context": [s.total_context_tokens / ATTENTION_UNIT for s in samples]},
                      [s.seconds for s in samples])


def fit_transfer(samples: list[TransferSample]) -> LinearFit:
    return fit_linear({"tokens": [s.num_tokens for s in samples]}, [s.seconds for s in samples])


# ---- where the figures come from ----------------------------------------------------------


def cpu_model_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def cpu_family_model(cpuinfo: str | None = None) -> str:
    """'family F, model M' from /proc/cpuinfo's first processor (or the text given), "" where
    it has neither: the model name alone ("AMD EPYC") does not tell a Zen 4 from a Zen 5."""
    from common.engine.device import first_cpu_fields
    fields = first_cpu_fields(cpuinfo)
    if "cpu family" not in fields or "model" not in fields:
        return ""
    return f"family {fields['cpu family']}, model {fields['model']}"


def machine_info(num_threads: int, device: str = "cpu") -> Machine:
    return Machine(cpu_model=cpu_model_name(), num_cpus=len(os.sched_getaffinity(0)), num_threads=num_threads,
                   device=device, hostname=platform.node())


def versions() -> Versions:
    from importlib.metadata import PackageNotFoundError, version
    try:
        pdserve_version = version("pdserve")
    except PackageNotFoundError:
        pdserve_version = "unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = ""
    return Versions(pdserve=pdserve_version, git_commit=commit, torch=torch_version, python=platform.python_version())


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---- measuring ---------------------------------------------------------------------------


class StepTimer:
    """Runs an EngineCore and keeps each step's duration with what it scheduled."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps: list[tuple[list, float]] = []  # (scheduled requests, seconds)
        engine.step_observer = lambda output, seconds: self.steps.append((output.scheduled, seconds))
        self.vocab_size = engine.model_config.vocab_size
        self.rng = np.random.default_rng(0)
        self.count = 0

    def random_ids(self, n: int) -> list[int]:
        # Ids from the middle of the vocabulary: no special tokens, and every prompt its own.
        return self.rng.integers(100, self.vocab_size - 100, size=n).tolist()

    def add(self, prompt_ids: list[int], max_tokens: int) -> str:
        from common.engine.request import Request
        from common.engine.sampling_params import SamplingParams
        self.count += 1
        req_id = f"profile-{self.count}"
        self.engine.add_request(Request(req_id, prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                            ignore_eos=True)))
        return req_id

    def run_until_idle(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def measure_prefill(timer: StepTimer, new_tokens: list[int], cached_tokens: list[int], reps: int,
                    progress=None) -> list[PrefillSample]:
    """Each rep is one round over the whole grid: on a shared machine, load from other
    processes comes in bursts, and rounds spread a burst over every point's median
    instead of landing it on a few points (which skews the fit)."""
    block_size = timer.engine.config.cache.block_size
    points = [(n, k - k % block_size) for k in cached_tokens for n in new_tokens]  # only whole blocks are cached
    seconds: dict[tuple[int, int], list[float]] = {point: [] for point in points}
    for _ in range(reps):
        for n, k in points:
            prefix = timer.random_ids(k)
            if k:  # put the prefix in the cache first
                timer.add(prefix + timer.random_ids(1), max_tokens=1)
                timer.run_until_idle()
            timer.steps.clear()
            timer.add(prefix + timer.random_ids(n), max_tokens=1)
            timer.run_until_idle()
            # One step ran the whole uncached prompt (the budget is larger than any n).
            (scheduled, step_s), = timer.steps
            assert scheduled[0].start_pos == k and len(scheduled[0].token_ids) == n, "prefix not cached"
            seconds[(n, k)].append(step_s)
    samples = [PrefillSample(num_new_tokens=n, num_cached_tokens=k, seconds=statistics.median(seconds[(n, k)]))
               for n, k in points]
    if progress:
        for sample in samples:
            progress(f"prefill n={sample.num_new_tokens} k={sample.num_cached_tokens}: {sample.seconds * 1000:.1f} ms")
    return samples


def measure_decode(timer: StepTimer, batch_sizes: list[int], contexts: list[int], num_steps: int, reps: int = 1,
                   progress=None) -> list[DecodeSample]:
    """Median over reps rounds of the grid (see measure_prefill) of num_steps decode steps each."""
    points = [(batch, context) for context in contexts for batch in batch_sizes]
    step_seconds: dict[tuple[int, int], list[float]] = {point: [] for point in points}
    step_contexts: dict[tuple[int, int], list[int]] = {point: [] for point in points}
    budget = timer.engine.config.scheduler.max_num_batched_tokens
    for _ in range(reps):
        for batch, context in points:
            # Prompts are prefilled over several steps (the token budget): each request
            # decodes long enough that num_steps steps find all of them decoding.
            max_tokens = num_steps + 3 + -(-batch * context // budget)
            for _ in range(batch):
                timer.add(timer.random_ids(context), max_tokens=max_tokens)
            timer.steps.clear()
            timer.run_until_idle()
            # Steps where every running request decodes one token, once all are running.
            decode_steps = [(scheduled, s) for scheduled, s in timer.steps
                            if len(scheduled) == batch and all(len(r.token_ids) == 1 for r in scheduled)][:num_steps]
            step_seconds[(batch, context)] += [s for _, s in decode_steps]
            step_contexts[(batch, context)] += [sum(r.start_pos + 1 for r in scheduled)
                                                for scheduled, _ in decode_steps]
    samples = [DecodeSample(batch_size=batch,
                            total_context_tokens=int(statistics.median(step_contexts[(batch, context)])),
                            seconds=statistics.median(step_seconds[(batch, context)])) for batch, context in points]
    if progress:
        for sample in samples:
            progress(f"decode B={sample.batch_size} context={sample.total_context_tokens}: "
                     f"{sample.seconds * 1000:.1f} ms")
    return samples


def measure_transfer(token_counts: list[int], reps: int, progress=None) -> list[TransferSample]:
    """The ZeroMQ connector between two processes on loopback TCP (bench.transfer's pair)."""
    import tempfile

    from bench.transfer import BLOCK_SIZE, Bench
    samples = []
    with tempfile.TemporaryDirectory(prefix="pdserve-profile-") as workdir:
        bench = Bench(max(token_counts) // BLOCK_SIZE, workdir)
        try:
            bench.connector("tcp", 1)  # warm-up: connections, page faults
            for num_tokens in token_counts:
                num_blocks = max(1, num_tokens // BLOCK_SIZE)
                seconds = statistics.median(bench.connector("tcp", num_blocks) for _ in range(reps))
                samples.append(TransferSample(num_tokens=num_blocks * BLOCK_SIZE, seconds=seconds))
                if progress:
                    progress(f"transfer {num_blocks * BLOCK_SIZE} tokens: {seconds * 1000:.2f} ms")
        finally:
            bench.close()
    return samples


def int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the profile JSON to write")
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads: the cores one instance gets (default 1)")
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--prefill-tokens", type=int_list, default=[32, 128, 256, 512, 1024])
    parser.add_argument("--cached-tokens", type=int_list, default=[0, 512])
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 4, 16, 32])
    parser.add_argument("--contexts", type=int_list, default=[128, 512], help="context tokens per request")
    parser.add_argument("--decode-steps", type=int, default=6, help="decode steps timed per (batch, context)")
    parser.add_argument("--transfer-tokens", type=int_list, default=[256, 1024, 4096])
    parser.add_argument("--no-transfer", action="store_true",
                        help="skip the KV transfer (its fit is then zero: colocated planning only)")
    parser.add_argument("--reps", type=int, default=3, help="rounds over each grid")
    return parser


def run_profile(args: argparse.Namespace, progress=print) -> Profile:
    import torch

    from common.engine.config import make_engine_config
    from common.engine.engine_core import EngineCore
    torch.set_num_threads(args.threads)
    longest = max(args.prefill_tokens) + max(args.cached_tokens) + 1
    config = make_engine_config(args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                                max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=max(longest, 2048),
                                max_model_len=max(longest, max(args.contexts) + args.decode_steps + 4))
    engine = EngineCore(config)
    timer = StepTimer(engine)
    timer.add(timer.random_ids(64), max_tokens=4)  # warm-up: first-call costs are not a step's
    timer.run_until_idle()
    prefill = measure_prefill(timer, args.prefill_tokens, args.cached_tokens, args.reps, progress)
    decode = measure_decode(timer, args.batch_sizes, args.contexts, args.decode_steps, args.reps, progress)
    transfer = [] if args.no_transfer else measure_transfer(args.transfer_tokens, args.reps, progress)
    bytes_per_block = engine.executor.kv_bytes_per_block()
    engine.shutdown()
    return Profile(
        created=now_iso(), machine=machine_info(args.threads), versions=versions(),
        engine=EngineSettings(model=engine.model_dir.name, dtype=args.dtype, block_size=config.cache.block_size,
                              kv_bytes_per_token=bytes_per_block // config.cache.block_size),
        prefill_samples=prefill, decode_samples=decode, transfer_samples=transfer,
        prefill_fit=fit_prefill(prefill), decode_fit=fit_decode(decode),
        transfer_fit=fit_transfer(transfer) if transfer else LinearFit(intercept_s=0.0, coefficients={"tokens": 0.0}))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    profile = run_profile(args)
    profile.dump(args.out)
    for name, fit in (("prefill", profile.prefill_fit), ("decode", profile.decode_fit),
                      ("transfer", profile.transfer_fit)):
        terms = " + ".join(f"{c:.3g}*{n}" for n, c in fit.coefficients.items())
        print(f"{name}: {fit.intercept_s:.4g} s + {terms}  (r2 {fit.r2 if fit.r2 is None else round(fit.r2, 4)})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
