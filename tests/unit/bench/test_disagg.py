"""bench.disagg without the model: the arms' stack configs, the workload,
the mixed run against a scripted backend, and the window's figures; plus
LocalStack's per-role options that the arms use."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from bench.disagg import (
    DECODE,
    LONG,
    DisaggConfig,
    MixedRun,
    TrackedOutcome,
    build_parser,
    decode_request_stream,
    long_requests,
    make_arms,
    run_mixed,
    window_metrics,
)
from bench.serve.datasets import BenchRequest, Vocabulary, ranged_requests
from bench.serve.metrics import RequestOutcome
from common.cli.processes import route_flags
from common.cli.up import LocalStack

VOCAB = Vocabulary(1000, frozenset({0, 999}))


def flag_value(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def test_arms_pin_disaggregated_roles_to_one_core_each_and_colocated_to_both():
    cfg = DisaggConfig(chunk_tokens=256, kv_cache_memory="1GiB")
    disagg, colocated, chunked = make_arms(cfg, (2, 5))
    assert (disagg.name, disagg.num_prefill) == ("disaggregated", 1)
    assert disagg.cpu_affinity == {"prefill": {2}, "decode": {5}}
    assert colocated.num_prefill == chunked.num_prefill == 0
    assert colocated.cpu_affinity == chunked.cpu_affinity == {"decode": {2, 5}}
    routed = {arm.name: route_flags(list(arm.passthrough)) for arm in (disagg, colocated, chunked)}
    assert flag_value(routed["disaggregated"]["decode"], "--local-prefill-threshold") == "0"
    assert "--no-chunked-prefill" not in routed["disaggregated"]["decode"]
    assert "--no-chunked-prefill" in routed["colocated"]["decode"]
    assert flag_value(routed["colocated"]["decode"], "--max-num-batched-tokens") == "4096"
    assert "--no-chunked-prefill" not in routed["colocated-chunked"]["decode"]
    assert flag_value(routed["colocated-chunked"]["decode"], "--max-num-batched-tokens") == "256"
    for name in ("colocated", "colocated-chunked"):
        assert int(flag_value(routed[name]["decode"], "--local-prefill-threshold")) > 2048
    for flags in routed.values():  # every engine the same pool size
        assert all(flag_value(flags[role], "--kv-cache-memory") == "1GiB" for role in ("prefill", "decode"))
    assert [a.name for a in make_arms(DisaggConfig(arms=("colocated",)), (0, 1))] == ["colocated"]


def test_local_stack_role_options_are_checked_and_set_thread_counts():
    stack = LocalStack(1, 1, cpu_affinity={"prefill": {0}, "decode": {0, 1}},
                       role_flags={"prefill": ["--kv-cache-memory", "64MiB"]}, env={"A": "1"})
    token = {"PDSERVE_REGISTRY_TOKEN": stack.registry_token}  # every process shares the stack's
    assert stack._role_env("prefill") == {"A": "1", "OMP_NUM_THREADS": "1", **token}
    assert stack._role_env("decode") == {"A": "1", "OMP_NUM_THREADS": "2", **token}
    assert stack._role_env("gateway") == {"A": "1", **token}
    with pytest.raises(ValueError, match="unknown role"):
        LocalStack(1, 1, cpu_affinity={"decoder": {0}})
    with pytest.raises(ValueError, match="unknown role"):
        LocalStack(1, 1, role_flags={"prefil": []})


def test_workload_lengths_kinds_and_seeding():
    cfg = DisaggConfig(rates=(0.1, 0.2), long_duration_s=40, decode_output_range=(128, 384))
    longs = long_requests(cfg, VOCAB, 1, 0.2)
    assert len(longs) == cfg.num_long(0.2) == 8 and cfg.num_long(0.01) == 2
    assert all(r.kind == LONG and 1024 <= r.prompt_len <= 2048 and r.output_len == 16 for r in longs)
    assert [r.prompt for r in longs] == [r.prompt for r in long_requests(cfg, VOCAB, 1, 0.2)]
    assert [r.prompt for r in longs] != [r.prompt for r in long_requests(cfg, VOCAB, 0, 0.2)]
    stream = decode_request_stream(cfg, VOCAB, 0)
    decodes = [next(stream) for _ in range(200)]  # more than one generated batch
    assert all(r.kind == DECODE and 32 <= r.prompt_len <= 64 and 128 <= r.output_len <= 384 for r in decodes)
    assert len({tuple(r.prompt) for r in decodes}) == 200
    with pytest.raises(ValueError):
        ranged_requests(2, VOCAB, np.random.default_rng(0), (10, 5), (1, 1))


def test_config_checks_and_cli():
    for bad in (dict(arms=("split",)), dict(rates=()), dict(rates=(float("inf"),)), dict(num_decode_streams=0),
                dict(long_input_range=(1024, 8192)), dict(chunk_tokens=8)):
        with pytest.raises(ValueError):
            DisaggConfig(**bad).check()
    args = build_parser().parse_args(["--rates", "0.05,0.1", "--long-input-len", "512-1024", "--arms", "colocated"])
    assert args.rates == "0.05,0.1" and args.long_input_len == (512, 1024)


def outcome(start_s: float, offsets: list[float], error: str = "", prompt_len: int = 10) -> RequestOutcome:
    return RequestOutcome(prompt_len=prompt_len, start_s=start_s, chunk_offsets_s=offsets,
                          chunk_tokens=[1] * len(offsets), error=error)


def test_window_metrics_count_only_what_falls_in_the_window():
    run = MixedRun([
        # a decode stream: gaps of 0.1 s, then a 2 s stall inside the window, finished inside it
        TrackedOutcome(DECODE, outcome(0.0, [0.5, 0.6, 0.7, 2.7, 2.8]), 0),
        # cancelled at the window's end: its gaps count, it is neither finished nor failed
        TrackedOutcome(DECODE, outcome(1.0, [0.2, 0.3, 0.4, 4.5], error="cancelled: the window closed"), 1),
        TrackedOutcome(LONG, outcome(1.0, [1.5, 1.6], prompt_len=1500)),
        TrackedOutcome(LONG, outcome(2.0, [], error="UNAVAILABLE: gone", prompt_len=1500)),
    ], window_start_s=0.55, window_end_s=3.0)
    figures = window_metrics(run, slo_ttft_ms=2000, slo_tpot_ms=500)
    # stream 0: gaps ending at 0.6, 0.7, 2.7, 2.8 (0.1, 0.1, 2.0, 0.1); stream 1: at 1.3, 1.4 (0.1, 0.1)
    assert figures["num_itl_samples"] == 6
    assert figures["max_itl_ms"] == pytest.approx(2000)
    assert figures["median_itl_ms"] == pytest.approx(100)
    assert figures["decode_time_in_gaps_over_1s"] == pytest.approx(2.0 / 2.5)
    assert figures["decode_finished"] == 1 and figures["decode_failed"] == 0
    assert (figures["num_long"], figures["long_completed"], figures["long_failed"]) == (2, 1, 1)
    # tokens in [0.55, 3.0]: stream 0 at 0.6, 0.7, 2.7, 2.8; stream 1 at 1.2, 1.3, 1.4; long at 2.5, 2.6
    assert figures["output_throughput"] == pytest.approx(9 / 2.45)
    # finished in the window: decode 0 (TTFT 0.5 s, TPOT 0.575 s > 0.5: not good) and the long one (good)
    assert figures["request_throughput"] == pytest.approx(2 / 2.45)
    assert figures["request_goodput"] == pytest.approx(1 / 2.45)
    assert figures["long_goodput"] == pytest.approx(1 / 2.45) and figures["decode_goodput"] == 0
    assert figures["long_median_ttft_ms"] == pytest.approx(1500)
    assert figures["decode_median_ttft_ms"] == pytest.approx(200)  # only stream 1's started in the window
    assert len(figures["itls_ms"]) == 6
    assert figures["finished"] == {"kind": [DECODE, LONG], "ttft_ms": [500.0, 1500.0], "tpot_ms": [575.0, 100.0]}


class ScriptedBackend:
    """Streams output_len tokens, one every `gap_s` (the first after gap_s); a long prompt
    takes `long_first_s` before its first token."""

    def __init__(self, gap_s: float = 0.005, long_first_s: float = 0.05):
        self.gap_s, self.long_first_s = gap_s, long_first_s
        self.num_calls = {DECODE: 0, LONG: 0}
        self.closed = 0

    async def stream(self, request: BenchRequest):
        self.num_calls[request.kind] += 1
        try:
            await asyncio.sleep(self.long_first_s if request.kind == LONG else self.gap_s)
            for _ in range(request.output_len):
                yield time.perf_counter(), 1
                await asyncio.sleep(self.gap_s)
        finally:
            self.closed += 1


def test_run_mixed_opens_the_window_after_every_stream_started_and_cancels_decodes_at_its_end():
    cfg = DisaggConfig(decode_output_range=(20, 30))
    backend = ScriptedBackend()
    longs = ranged_requests(3, VOCAB, np.random.default_rng(0), (20, 30), (4, 4), LONG)
    run = asyncio.run(run_mixed(backend, decode_request_stream(cfg, VOCAB, 0), longs, rate=40.0, num_streams=3,
                                seed=0, max_window_s=10.0))
    assert not run.timed_out and run.window_end_s > run.window_start_s
    decode = [t for t in run.outcomes if t.kind == DECODE]
    long = [t for t in run.outcomes if t.kind == LONG]
    assert {t.stream for t in decode} == {0, 1, 2}
    assert len(long) == 3 and all(t.outcome.success and t.done and t.outcome.output_tokens == 4 for t in long)
    assert all(t.outcome.start_s >= run.window_start_s for t in long)
    first_tokens = [t.outcome.start_s + t.outcome.chunk_offsets_s[0] for t in decode if t.outcome.chunk_offsets_s]
    assert min(first_tokens) <= run.window_start_s  # each stream had its first token before the window
    cancelled = [t for t in decode if t.outcome.error.startswith("cancelled")]
    assert len(cancelled) == 3 and all(not t.done for t in cancelled)  # one per stream, still running
    assert backend.closed == backend.num_calls[DECODE] + backend.num_calls[LONG]  # every stream closed
    figures = window_metrics(run, 1000, 1000)
    assert figures["num_itl_samples"] > 0 and figures["long_completed"] == 3


@pytest.mark.timing
def test_run_mixed_times_out_and_records_the_unfinished_long_prompts():
    backend = ScriptedBackend(long_first_s=30.0)
    longs = ranged_requests(2, VOCAB, np.random.default_rng(0), (20, 30), (4, 4), LONG)
    started = time.perf_counter()
    run = asyncio.run(run_mixed(backend, decode_request_stream(DisaggConfig(), VOCAB, 0), longs, rate=100.0,
                                num_streams=1, seed=0, max_window_s=0.3))
    assert time.perf_counter() - started < 5
    assert run.timed_out
    assert all(t.outcome.error.startswith("cancelled") for t in run.outcomes if t.kind == LONG)
    assert window_metrics(run, 1000, 1000)["long_failed"] == 2


def test_a_saved_result_is_rescored_at_another_slo_and_plotted(tmp_path):
    import json
    pytest.importorskip("matplotlib")

    from bench.disagg import main
    run = {"rate": 0.1, "window_s": 10.0, "long_failed": 0, "decode_failed": 0, "itls_ms": [100.0, 900.0],
           "output_throughput": 12.5,
           "p99_itl_ms": 892.0, "request_goodput": 0.0,
           "finished": {"kind": [DECODE, DECODE, LONG], "ttft_ms": [500.0, 800.0, 9000.0],
                        "tpot_ms": [150.0, 400.0, None]}}
    saved = {"config": {"slo_ttft_ms": 1.0, "slo_tpot_ms": 1.0}, "arms": [{"arm": "colocated", "runs": [run]}],
             "client_headroom": {"client_over_stack_wall": None}}
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(saved))
    out = tmp_path / "rescored.json"
    assert main(["--from-json", str(path), "--slo-ttft-ms", "10000", "--slo-tpot-ms", "200", "--json", str(out),
                 "--plot", str(tmp_path / "plots")]) == 0
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"disagg_itl_cdf.png", "disagg_goodput_vs_rate.png"}
    rescored = json.loads(out.read_text())
    assert rescored["config"]["slo_tpot_ms"] == 200
    # good: the first decode (TPOT 150) and the long prompt (TTFT 9 s, no TPOT); not the 400 ms one
    assert rescored["arms"][0]["runs"][0]["request_goodput"] == pytest.approx(0.2)
    assert rescored["arms"][0]["runs"][0]["decode_goodput"] == pytest.approx(0.1)
    assert main(["--from-json", str(tmp_path / "missing.json")]) == 2
