"""When each request is sent: gamma-distributed gaps, as `vllm bench serve` does.

Gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate whatever
the burstiness, coefficient of variation 1/sqrt(burstiness). Burstiness 1 is a
Poisson process; below 1 the arrivals bunch up, above 1 they even out.

Like vLLM (since 0.10), the cumulative send times are rescaled so the last request
goes out at exactly num_requests/rate: a raw gamma sum wanders a percent or two from
that, which would move throughput figures from one seed to the next. The first
request also waits one gap, as in vLLM. Rate inf sends everything at time 0.
"""
from __future__ import annotations

import math

import numpy as np


def parse_rates(text: str) -> list[float]:
    """"1,2,4,inf" -> [1.0, 2.0, 4.0, inf]; each rate must be > 0."""
    rates = []
    for item in str(text).split(","):
        item = item.strip()
        try:
            rate = float(item)
        except ValueError:
            raise ValueError(f"--request-rate: {item!r} is not a number or 'inf'") from None
        if not rate > 0:
            raise ValueError(f"--request-rate: {item!r} must be > 0 (use inf for all at once)")
        rates.append(rate)
    return rates


def send_offsets(num_requests: int, rate: float, burstiness: float = 1.0,
                 seed: int | np.random.Generator = 0) -> np.ndarray:
    """Seconds after the start at which each request is sent, nondecreasing."""
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if num_requests == 0 or math.isinf(rate):
        return np.zeros(num_requests)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests)
    offsets = np.cumsum(gaps)
    return offsets * ((num_requests / rate) / offsets[-1])


def gaps_of(offsets: np.ndarray) -> np.ndarray:
    """Inter-arrival gaps, the first measured from time 0."""
    return np.diff(np.asarray(offsets, dtype=float), prepend=0.0)
