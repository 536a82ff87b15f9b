"""bench.routing without processes: the shared-system-prompt workload,
the stack's flags, the ideal bound and the simulation replay."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from bench.routing import (
    RoutingConfig, build_parser, format_summary, ideal_hit_rate, main, replay_in_simulator, summarize_arms)
from bench.serve.datasets import BenchRequest, Vocabulary, system_prompt_requests
from common.cli.processes import route_flags

VOCAB = Vocabulary(1000, frozenset({0, 1, 2, 999}))


def requests(num=48, seed=0, **options):
    return system_prompt_requests(num, VOCAB, np.random.default_rng(seed), **options)


def test_each_tenant_repeats_its_system_prompt_with_a_unique_user_part():
    batch = requests(64, num_tenants=8, system_prompt_len=512, user_len_range=(64, 128), output_len_range=(8, 16))
    by_tenant: dict[str, list[BenchRequest]] = {}
    for r in batch:
        by_tenant.setdefault(r.kind, []).append(r)
    assert sorted(by_tenant) == [f"tenant-{t}" for t in range(8)]
    system_prompts = {kind: tuple(rs[0].prompt[:512]) for kind, rs in by_tenant.items()}
    assert len(set(system_prompts.values())) == 8  # different tenants, different system prompts
    for kind, rs in by_tenant.items():
        assert all(tuple(r.prompt[:512]) == system_prompts[kind] for r in rs)
    user_parts = [tuple(r.prompt[512:]) for r in batch]
    assert len(set(user_parts)) == len(batch)
    assert all(64 <= len(u) <= 128 for u in user_parts) and len({len(u) for u in user_parts}) > 10
    assert all(r.prompt_len == len(r.prompt) and 8 <= r.output_len <= 16 for r in batch)
    assert not {i for r in batch for i in r.prompt} & VOCAB.special_ids


def test_rounds_order_sends_every_tenant_once_per_round_random_order_does_not():
    rounds = requests(80, tenant_order="rounds")
    for start in range(0, 80, 8):
        assert sorted(r.kind for r in rounds[start:start + 8]) == sorted(f"tenant-{t}" for t in range(8))
    assert [r.kind for r in rounds[:8]] != [r.kind for r in rounds[8:16]]  # shuffled within rounds
    drawn = requests(400, tenant_order="random")
    counts = Counter(r.kind for r in drawn)
    assert len(counts) == 8 and max(counts.values()) - min(counts.values()) > 0
    assert any(sorted(r.kind for r in drawn[s:s + 8]) != sorted(counts) for s in range(0, 400, 8))


def test_workload_is_deterministic_in_the_seed_and_bad_options_fail():
    assert [r.prompt for r in requests(seed=3)] == [r.prompt for r in requests(seed=3)]
    assert [r.prompt for r in requests(seed=3)] != [r.prompt for r in requests(seed=4)]
    for bad in (dict(num_tenants=0), dict(tenant_order="zigzag"), dict(user_len_range=(10, 5)),
                dict(output_len_range=(0, 4)), dict(max_model_len=600)):
        with pytest.raises(ValueError):
            requests(**bad)


def test_ideal_hit_rate_counts_every_system_prompt_once():
    batch = [BenchRequest([0] * 100, 100, 1, "tenant-0"), BenchRequest([0] * 100, 100, 1, "tenant-1"),
             BenchRequest([0] * 100, 100, 1, "tenant-0"), BenchRequest([0] * 100, 100, 1, "tenant-0")]
    # system prompt 40 tokens = 2 whole blocks of 16: 32 cacheable tokens, hit by the 2 repeats
    assert ideal_hit_rate(batch, 40, 16) == pytest.approx(2 * 32 / 400)


def test_stack_flags_route_policy_to_gateway_and_keep_decode_from_prefilling():
    cfg = RoutingConfig()
    passthrough, role_flags = cfg.stack_flags("round_robin", 123456789)
    routed = route_flags(passthrough)  # every flag is one some command takes
    assert routed["gateway"][routed["gateway"].index("--policy") + 1] == "round_robin"
    decode = routed["decode"]
    assert decode[decode.index("--local-prefill-threshold") + 1] == "0"
    assert "--local-prefill-threshold" not in routed["prefill"]
    assert role_flags == {"prefill": ["--kv-cache-memory", "123456789"]}


def test_config_checks_and_cli():
    with pytest.raises(ValueError, match="policies"):
        RoutingConfig(policies=("random",)).check()
    with pytest.raises(ValueError, match="prefill-kv-blocks"):
        RoutingConfig(prefill_kv_blocks=8).check()
    with pytest.raises(ValueError):
        RoutingConfig(concurrencies=(1, 0)).check()
    args = build_parser().parse_args(["--user-len", "32-48", "--output-len", "4", "--policies", "prefix_aware",
                                      "--max-concurrency", "1,3"])
    assert args.user_len == (32, 48) and args.output_len == (4, 4) and args.policies == "prefix_aware"
    assert args.max_concurrency == "1,3"
    assert main(["--max-concurrency", "one"]) == 2 and main(["--policies", "random"]) == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--user-len", "a-b"])


def test_replay_runs_every_simulated_policy_on_the_exact_requests():
    cfg = RoutingConfig(num_requests=64)
    batch = requests(64, seed=1)
    send_times = [0.05 * i for i in range(64)]
    hit_rates = replay_in_simulator(batch, send_times, cfg, cache_blocks=160, prefill_tokens_per_s=20_000)
    assert set(hit_rates) == {"round_robin", "least_loaded", "prefix_aware", "oracle"}
    ideal = ideal_hit_rate(batch, cfg.system_prompt_len, cfg.block_size)
    assert all(0 <= rate <= ideal + 1e-9 for rate in hit_rates.values())
    assert hit_rates["oracle"] > hit_rates["round_robin"]


def measured_arm(batch: list[BenchRequest], hit_tokens: int) -> dict:
    """One policy's result as run_policy records it, for a run where every request finished."""
    queried = sum(r.prompt_len for r in batch)
    return {"hit_rate": hit_tokens / queried, "queried_tokens": queried, "hit_tokens": hit_tokens,
            "mean_ttft_ms": 120.0, "ttfts": [0.12] * len(batch), "start_times": [0.2 * i for i in range(len(batch))],
            "per_instance": {"prefill-0": {"total_blocks": 160}, "prefill-1": {"total_blocks": 160}}}


def test_summary_of_a_workload_where_no_prefix_repeats_has_no_ratios():
    cfg = RoutingConfig(num_requests=6)
    batch = requests(6, seed=2, tenant_order="rounds")  # 6 requests over 8 tenants: none repeats
    assert len({r.kind for r in batch}) == 6
    ideal = ideal_hit_rate(batch, cfg.system_prompt_len, cfg.block_size)
    assert ideal == 0
    arms = summarize_arms({p: measured_arm(batch, 0) for p in ("least_loaded", "prefix_aware")}, batch, cfg, ideal)
    summary = arms["summary"]
    assert summary["simulated_hit_rate"]["oracle"] == 0
    assert "prefix_aware_over_simulated_oracle" not in summary and "prefix_aware_over_ideal" not in summary
    text = format_summary(arms, cfg, concurrency=1)
    assert "no system prompt repeats" in text and "oracle (simulated" not in text


def test_summary_of_a_repeating_workload_gives_the_ratios():
    cfg = RoutingConfig(num_requests=32)
    batch = requests(32, seed=2)
    ideal = ideal_hit_rate(batch, cfg.system_prompt_len, cfg.block_size)
    hit_tokens = int(ideal * sum(r.prompt_len for r in batch))
    arms = summarize_arms({"prefix_aware": measured_arm(batch, hit_tokens)}, batch, cfg, ideal)
    summary = arms["summary"]
    assert summary["prefix_aware_over_ideal"] == pytest.approx(1.0, abs=1e-3)
    assert summary["prefix_aware_over_simulated_oracle"] >= 1.0 - 1e-3  # the oracle never beats the ideal
    assert "/ ideal = 100.0%" in format_summary(arms, cfg, concurrency=1)
