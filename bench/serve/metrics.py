"""Per-request outcomes -> the benchmark's figures, with vLLM's definitions.

vLLM (`vllm bench serve`, benchmarks/serve.py calculate_metrics) is followed
deliberately so our numbers compare with published ones:
- TTFT: arrival of the first chunk carrying a token, minus the send time.
- E2EL: arrival of the last chunk carrying a token, minus the send time.
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request; requests with one output
  token have no TPOT (and count as TPOT 0 when checking a goodput SLO, as vLLM does).
- ITL: every gap between consecutive token-carrying chunks, pooled over requests.
- throughputs and goodput: over the benchmark's wall duration; input tokens are
  counted for successful requests only.
- percentiles: numpy's linear interpolation; std: population (ddof=0).
Where vLLM prints 0 for a metric with no samples we report None (null in JSON),
so that "no data" cannot be read as "zero latency".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

LATENCY_METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                   "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # what --goodput may constrain (vLLM's set)


@dataclass
class RequestOutcome:
    """What one request did, as the client saw it. Times are perf_counter seconds."""

    prompt_len: int
    start_s: float = 0.0  # send time, relative to the benchmark's start
    chunk_offsets_s: list[float] = field(default_factory=list)  # each token-carrying chunk, after send
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those chunks
    error: str = ""  # empty for a success

    @property
    def success(self) -> bool:
        # vLLM counts a stream that ended cleanly without a single token as failed too.
        return not self.error and bool(self.chunk_offsets_s)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_s(self) -> float:
        return self.chunk_offsets_s[0]

    @property
    def latency_s(self) -> float:
        return self.chunk_offsets_s[-1]

    @property
    def itl_s(self) -> list[float]:
        offsets = self.chunk_offsets_s
        return [later - earlier for earlier, later in zip(offsets, offsets[1:])]

    @property
    def tpot_s(self) -> float | None:
        n = self.output_tokens
        return (self.latency_s - self.ttft_s) / (n - 1) if n > 1 else None


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        for pair in item.replace(",", " ").split():
            name, sep, value = pair.partition(":")
            if not sep or name not in GOODPUT_METRICS:
                raise ValueError(f"--goodput takes KEY:MILLISECONDS with KEY in "
                                 f"{', '.join(GOODPUT_METRICS)}; got {pair!r}")
            try:
                slos[name] = float(value)
            except ValueError:
                raise ValueError(f"--goodput {pair!r}: {value!r} is not a number") from None
            if not slos[name] >= 0:
                raise ValueError(f"--goodput {pair!r}: the SLO must be >= 0 ms")
    return slos


def percentile_label(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize(name: str, samples_s: list[float], percentiles: list[float]) -> dict[str, float | None]:
    """mean/median/std/pNN of samples in seconds, as {f"mean_{name}_ms": ...} in ms."""
    values = np.asarray(samples_s, dtype=float) * 1000.0
    empty = values.size == 0
    out = {f"mean_{name}_ms": None if empty else float(values.mean()),
           f"median_{name}_ms": None if empty else float(np.median(values)),
           f"std_{name}_ms": None if empty else float(values.std())}
    for p in percentiles:
        out[f"{percentile_label(p)}_{name}_ms"] = None if empty else float(np.percentile(values, p))
    return out


def is_good(outcome: RequestOutcome, slos_ms: dict[str, float]) -> bool:
    measured = {"ttft": outcome.ttft_s, "tpot": outcome.tpot_s or 0.0, "e2el": outcome.latency_s}
    return all(measured[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def peak_rates(completed: list[RequestOutcome]) -> tuple[float, int]:
    """vLLM's peaks: most output tokens in one 1-second bucket, and most requests active
    at some time within one bucket (which can exceed the true simultaneous peak)."""
    if not completed:
        return 0.0, 0
    origin = min(o.start_s for o in completed)
    num_buckets = int(math.ceil(max(o.start_s + o.latency_s for o in completed) - origin)) + 1
    tokens = np.zeros(num_buckets)
    active = np.zeros(num_buckets, dtype=int)
    for o in completed:
        for offset, n in zip(o.chunk_offsets_s, o.chunk_tokens):
            tokens[int(o.start_s + offset - origin)] += n
        first, last = int(o.start_s - origin), int(o.start_s + o.latency_s - origin)
        active[first:last + 1] += 1
    return float(tokens.max()), int(active.max())


def compute_metrics(outcomes: list[RequestOutcome], duration_s: float, slos_ms: dict[str, float] | None = None,
                    percentiles: list[float] = (90, 99)) -> dict:
    """Every figure of one run, under vLLM's JSON key names, plus per-request arrays."""
    completed = [o for o in outcomes if o.success]
    total_input = sum(o.prompt_len for o in completed)
    total_output = sum(o.output_tokens for o in completed)
    peak_tokens_per_s, peak_concurrency = peak_rates(completed)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    metrics = {
        "duration": duration_s, "completed": len(completed), "failed": len(outcomes) - len(completed),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": per_s(len(completed)),
        "request_goodput": per_s(sum(is_good(o, slos_ms) for o in completed)) if slos_ms else None,
        "output_throughput": per_s(total_output),
        "total_token_throughput": per_s(total_input + total_output),
        "max_output_tokens_per_s": peak_tokens_per_s, "max_concurrent_requests": peak_concurrency,
    }
    samples = {"ttft": [o.ttft_s for o in completed],
               "tpot": [o.tpot_s for o in completed if o.tpot_s is not None],
               "itl": [gap for o in completed for gap in o.itl_s],
               "e2el": [o.latency_s for o in completed]}
    for name in LATENCY_METRICS:
        metrics.update(summarize(name, samples[name], percentiles))
    # Per-request arrays (seconds, like vLLM's ttfts/itls), in send order: enough to
    # recompute every figure above or plot any distribution later.
    metrics.update({
        "input_lens": [o.prompt_len for o in outcomes],
        "output_lens": [o.output_tokens if o.success else 0 for o in outcomes],
        "start_times": [o.start_s for o in outcomes],
        "ttfts": [o.ttft_s if o.success else None for o in outcomes],
        "e2els": [o.latency_s if o.success else None for o in outcomes],
        "tpots": [o.tpot_s if o.success else None for o in outcomes],
        "itls": [o.itl_s if o.success else [] for o in outcomes],
        "errors": [o.error for o in outcomes],
    })
    return metrics


def format_report(metrics: dict, percentiles: list[float], title: str = "Serving Benchmark Result") -> str:
    """The run's figures laid out like vLLM's printout."""
    def fmt(value, digits=2):
        return "n/a" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    lines = [f"{' ' + title + ' ':=^50}"]
    rows = [("Successful requests:", metrics["completed"]), ("Failed requests:", metrics["failed"]),
            ("Benchmark duration (s):", metrics["duration"]),
            ("Total input tokens:", metrics["total_input_tokens"]),
            ("Total generated tokens:", metrics["total_output_tokens"]),
            ("Request throughput (req/s):", metrics["request_throughput"])]
    if metrics["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", metrics["request_goodput"]))
    rows += [("Output token throughput (tok/s):", metrics["output_throughput"]),
             ("Peak output token throughput (tok/s):", metrics["max_output_tokens_per_s"]),
             ("Peak concurrent requests:", metrics["max_concurrent_requests"]),
             ("Total token throughput (tok/s):", metrics["total_token_throughput"])]
    lines += [f"{label:<40} {fmt(value):<10}" for label, value in rows]
    for name, heading in LATENCY_METRICS.items():
        upper = name.upper()
        lines.append(f"{heading:-^50}")
        stats = [("Mean", "mean"), ("Median", "median"), ("Std", "std")]
        stats += [(percentile_label(p).upper(), percentile_label(p)) for p in percentiles]
        lines += [f"{f'{label} {upper} (ms):':<40} {fmt(metrics[f'{key}_{name}_ms']):<10}"
                  for label, key in stats]
    lines.append("=" * 50)
    return "\n".join(lines)
