"""bench.serve.arrivals: gamma gaps with the right mean rate and burstiness."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bench.serve.arrivals import gaps_of, parse_rates, send_offsets

N = 20_000


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_mean_rate_and_coefficient_of_variation(burstiness):
    rate = 8.0
    gaps = gaps_of(send_offsets(N, rate, burstiness, seed=1))
    # vLLM's rescaling makes the last send land at exactly N/rate
    assert gaps.sum() == pytest.approx(N / rate)
    assert gaps.mean() == pytest.approx(1 / rate)
    # Gamma(shape k) has CV 1/sqrt(k): 2 for bursty 0.25, 1 for Poisson, 0.5 for steady 4
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert (gaps >= 0).all()


def test_poisson_gaps_look_exponential():
    gaps = gaps_of(send_offsets(N, 2.0, 1.0, seed=2))
    # P(gap > mean) = e^-1 for an exponential distribution
    assert (gaps > gaps.mean()).mean() == pytest.approx(math.exp(-1), abs=0.02)


def test_infinite_rate_sends_everything_at_once():
    assert np.array_equal(send_offsets(50, float("inf"), 0.5, seed=3), np.zeros(50))
    assert send_offsets(0, 4.0).size == 0


def test_seeded_and_nondecreasing():
    a, b = send_offsets(100, 3.0, 1.0, seed=7), send_offsets(100, 3.0, 1.0, seed=7)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, send_offsets(100, 3.0, 1.0, seed=8))
    assert (np.diff(a) >= 0).all()


def test_parse_rates():
    assert parse_rates("1,2, 4,inf") == [1.0, 2.0, 4.0, float("inf")]
    assert parse_rates("0.5") == [0.5]
    for bad in ("0", "-1", "fast", "1,,2"):
        with pytest.raises(ValueError):
            parse_rates(bad)
    with pytest.raises(ValueError):
        send_offsets(10, 1.0, burstiness=0)
