"""`pdserve tune`: the search on a synthetic engine with a known optimum, and real runs on a tiny model."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bench.plan import LengthRange, Traffic, make_requests
from bench.tune import (
    CANNOT_START,
    DOMINATED,
    OK,
    PRUNED,
    TPOT_LIMIT,
    TTFT_LIMIT,
    EngineBench,
    Grid,
    Limits,
    Measurement,
    Setting,
    adaptive,
    exhaustive,
    main,
)
from common.engine.config import parse_memory_size

GRID = Grid(max_num_seqs=(1, 2, 4, 8, 16, 32, 64), max_num_batched_tokens=(128, 512, 2048),
            kv_cache_memory=("8MiB", "32MiB", "256MiB"))


class SyntheticBench:
    """Throughput grows with the batch and the token budget; TPOT grows with the batch
    (over the limit from 64 sequences); 2 or fewer sequences keep requests waiting for a
    seat past the TTFT limit; an 8 MiB pool cannot start; a 32 MiB pool
    preempts at 32+ sequences. Best within limits: 32 sequences, 2048 tokens, 256 MiB."""

    def __init__(self):
        self.calls: list[Setting] = []

    def measure(self, setting: Setting, beat_throughput: float = 0.0) -> Measurement:
        self.calls.append(setting)
        if parse_memory_size(setting.kv_cache_memory) < 16 << 20:
            return Measurement(setting, CANNOT_START, detail="KV pool smaller than one request")
        if setting.max_num_seqs >= 64:
            return Measurement(setting, TPOT_LIMIT, seconds=1.0)
        if setting.max_num_seqs <= 2:
            return Measurement(setting, TTFT_LIMIT, seconds=1.0)
        throughput = 10 * math.log2(setting.max_num_seqs) + 5 * math.log2(setting.max_num_batched_tokens / 64)
        if parse_memory_size(setting.kv_cache_memory) < 64 << 20 and setting.max_num_seqs >= 32:
            throughput /= 3  # preemptions
        if throughput < beat_throughput:
            return Measurement(setting, DOMINATED, seconds=0.5)
        return Measurement(setting, OK, throughput, ttft_ms=100, tpot_ms=50, seconds=4.0)


def test_limits_count_what_makes_a_percentile_miss():
    limits = Limits(ttft_ms=100, tpot_ms=10, percentile=90)
    assert limits.num_over_to_miss(10) == 2  # floor(9 x 0.9) = 8: values 8 and 9 over
    values = np.array([1.0] * 8 + [200.0] * 2)
    assert np.percentile(values, 90) > 100
    assert limits.num_over_to_miss(1) == 1


def test_exhaustive_and_adaptive_agree_on_the_known_best():
    full = exhaustive(SyntheticBench(), GRID, progress=False)
    bench = SyntheticBench()
    tuned = adaptive(bench, GRID, progress=False)
    expected = Setting("float32", "256MiB", 2048, 32)
    assert full.best.setting == expected and tuned.best.setting == expected
    assert len(bench.calls) < len(GRID) / 2


def test_adaptive_prunes_what_cannot_start_or_breaks_tpot():
    bench = SyntheticBench()
    tuned = adaptive(bench, GRID, progress=False)
    statuses = {m.setting: m.status for m in tuned.measurements}
    # 8 MiB cannot start; it is tried once, not per line of the grid.
    assert sum(1 for s in bench.calls if s.kv_cache_memory == "8MiB") == 1
    assert all(status == CANNOT_START for s, status in statuses.items() if s.kv_cache_memory == "8MiB")
    assert Setting("float32", "256MiB", 2048, 64) in statuses  # the TPOT break was found on the walk
    # 2 sequences broke TTFT: 1 is never run (fewer seats only wait longer).
    assert statuses[Setting("float32", "256MiB", 2048, 2)] == TTFT_LIMIT
    assert not [s for s in bench.calls if s.max_num_seqs == 1]
    assert any(status == PRUNED for s, status in statuses.items() if s.max_num_seqs == 1)
    assert all(status in (OK, DOMINATED, CANNOT_START, TPOT_LIMIT, TTFT_LIMIT, PRUNED) for status in statuses.values())


@pytest.mark.timing
def test_cpu_clock_skips_idle_time_instead_of_sleeping():
    import time

    from bench.tune import CpuClock
    clock = CpuClock()
    started = time.perf_counter()
    clock.wait_until(30.0)
    assert clock.now() >= 30.0 and time.perf_counter() - started < 1.0


@pytest.fixture
def tiny_requests():
    traffic = Traffic(request_rate=1.0, input_len=LengthRange(low=16, high=48), output_len=LengthRange(low=4, high=8))
    requests = make_requests(traffic, 8, seed=0)
    for r in requests:
        r.arrival_s = 0.0
    return requests


def test_a_pool_too_small_for_one_request_cannot_start(tiny_llama_dir, tiny_requests):
    bench = EngineBench(str(tiny_llama_dir), "colocated", tiny_requests, Limits(60_000, 60_000), max_model_len=56)
    # The tiny model's KV: 512 bytes per token; 16 KiB hold 32 tokens < 56.
    m = bench.measure(Setting("float32", "16KiB", 64, 4))
    assert m.status == CANNOT_START and "max_model_len=56" in m.detail


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
def test_each_role_measures_a_tiny_model(tiny_llama_dir, tiny_requests, role):
    bench = EngineBench(str(tiny_llama_dir), role, tiny_requests, Limits(60_000, 60_000), max_model_len=56)
    m = bench.measure(Setting("float32", "1MiB", 64, 4))
    assert m.status == OK and m.throughput > 0 and m.ttft_ms > 0
    assert (m.tpot_ms is None) == (role == "prefill")


def test_a_run_stops_once_the_ttft_limit_is_certain_to_break(tiny_llama_dir, tiny_requests):
    # With one sequence at a time, most requests wait longer than 0.001 ms for their first token.
    bench = EngineBench(str(tiny_llama_dir), "colocated", tiny_requests, Limits(0.001, 60_000), max_model_len=56)
    assert bench.measure(Setting("float32", "1MiB", 64, 1)).status == TTFT_LIMIT


def test_a_run_that_cannot_beat_the_best_stops(tiny_llama_dir, tiny_requests):
    bench = EngineBench(str(tiny_llama_dir), "colocated", tiny_requests, Limits(60_000, 60_000), max_model_len=56)
    assert bench.measure(Setting("float32", "1MiB", 64, 4), beat_throughput=1e12).status == DOMINATED


def test_tune_command_writes_table_plot_and_env(tiny_llama_dir, tmp_path):
    env = tmp_path / "tune.env"
    code = main(["--model", str(tiny_llama_dir), "--num-requests", "6", "--input-len", "16-32",
                 "--output-len", "4-6", "--max-num-seqs", "2,4", "--max-num-batched-tokens", "64",
                 "--kv-cache-memory", "16KiB,1MiB", "--ttft-ms", "60000", "--search", "both",
                 "--json", str(tmp_path / "t.json"), "--plot", str(tmp_path / "t.png"), "--env-out", str(env),
                 "--no-progress"])
    assert code == 0
    text = env.read_text()
    assert "PDSERVE_KV_CACHE_MEMORY=1MiB" in text and "PDSERVE_MAX_NUM_BATCHED_TOKENS=64" in text
    assert (tmp_path / "t.png").stat().st_size > 0
    import json
    summary = json.loads((tmp_path / "t.json").read_text())
    assert [r["search"] for r in summary["runs"]] == ["adaptive", "exhaustive"]
    assert len(summary["runs"][1]["table"]) == 4 and "comparison" in summary


def test_a_run_measured_to_the_end_over_a_limit_is_not_feasible(tiny_llama_dir, tiny_requests, monkeypatch):
    from bench.tune import RequestTimes
    bench = EngineBench(str(tiny_llama_dir), "colocated", tiny_requests, Limits(1000, 100, percentile=90),
                        max_model_len=56)
    # Ten requests, TPOT 50 ms but one at 1 s: too few over the limit for an early stop
    # (two are needed), yet the p90 interpolates to 145 ms > 100 ms.
    times = [RequestTimes(0.0, 11, first_s=0.1, last_s=0.1 + 10 * 0.05, num_tokens=11) for _ in range(9)]
    times.append(RequestTimes(0.0, 11, first_s=0.1, last_s=0.1 + 10 * 1.0, num_tokens=11))
    monkeypatch.setattr(bench, "_run", lambda engine, beat: times)
    m = bench.measure(Setting("float32", "1MiB", 64, 4))
    assert m.tpot_ms == pytest.approx(145.0) and m.status == TPOT_LIMIT and not m.feasible()


def test_confirm_runs_the_best_again_and_drops_a_lucky_one():
    class LuckyOnce(SyntheticBench):
        """The true best (32 sequences) measures as it is; 16 sequences got one lucky first run."""
        def measure(self, setting, beat_throughput=0.0):
            m = super().measure(setting, 0.0)
            if m.feasible() and setting.max_num_seqs == 16 and self.calls.count(setting) == 1:
                m.throughput *= 1.2
            return m
    assert adaptive(LuckyOnce(), GRID, progress=False).best.setting.max_num_seqs == 16
    confirmed = adaptive(LuckyOnce(), GRID, progress=False, confirm=3)
    assert confirmed.best.setting == Setting("float32", "256MiB", 2048, 32)
    assert "mean" in confirmed.best.detail
