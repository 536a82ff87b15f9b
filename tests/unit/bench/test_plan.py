"""`pdserve plan` and its simulation on synthetic profiles with hand-computed answers."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from bench.plan import (
    LengthRange,
    Planner,
    PlanOptions,
    Slo,
    Traffic,
    analytic_estimate,
    decode_batch,
    k8s_overlay,
    main,
    make_requests,
    mg1_wait_quantile,
)
from bench.plan_sim import Deployment, InstanceShape, SimRequest, simulate
from bench.profile import EngineSettings, LinearFit, Machine, Profile, Versions


def synthetic_profile(prefill_per_token_s: float = 0.0, prefill_intercept_s: float = 0.0,
                      decode_intercept_s: float = 0.0, decode_per_seq_s: float = 0.0,
                      transfer_per_token_s: float = 0.0) -> Profile:
    return Profile(machine=Machine(cpu_model="synthetic", num_cpus=1, num_threads=1),
                   versions=Versions(pdserve="test"),
                   engine=EngineSettings(model="synthetic", dtype="float32", kv_bytes_per_token=1024),
                   prefill_fit=LinearFit(intercept_s=prefill_intercept_s,
                                         coefficients={"tokens": prefill_per_token_s, "attention": 0.0}),
                   decode_fit=LinearFit(intercept_s=decode_intercept_s,
                                        coefficients={"batch": decode_per_seq_s, "context": 0.0}),
                   transfer_fit=LinearFit(intercept_s=0.0, coefficients={"tokens": transfer_per_token_s}))


def fixed(n: int) -> LengthRange:
    return LengthRange(low=n, high=n)


# One request per prefill step (the budget is one prompt), so a prefill instance is an
# M/D/1 queue with S = 100 tokens x 1 ms = 0.1 s.
ONE_PROMPT_PER_STEP = InstanceShape(max_num_seqs=64, max_num_batched_tokens=100, num_kv_blocks=4096,
                                    max_model_len=512)


def test_mg1_wait_matches_pollaczek_khinchine_and_mm1():
    # M/D/1 at rho 0.5, S = 0.1 s: E[W] = rho S / (2 (1 - rho)) = 0.05 s.
    mean_wait, _ = mg1_wait_quantile(5.0, np.array([0.1]), 90)
    assert mean_wait == pytest.approx(0.05)
    # M/M/1 (exponential S, mean 0.1 s, E[S^2] = 2 * 0.01) at rho 0.5: the wait's p90 is
    # ln(rho / 0.1) / (mu - lambda) = ln 5 / 5 s exactly.
    exponential = np.random.default_rng(0).exponential(0.1, 200_000)
    mean_wait, p90 = mg1_wait_quantile(5.0, exponential, 90)
    assert mean_wait == pytest.approx(0.1, rel=0.02)
    assert p90 == pytest.approx(math.log(5) / 5, rel=0.02)
    assert mg1_wait_quantile(10.0, np.array([0.1]), 90) == (math.inf, math.inf)  # rho = 1


def test_simulated_prefill_queue_waits_as_md1():
    profile = synthetic_profile(prefill_per_token_s=0.001)
    traffic = Traffic(request_rate=5.0, input_len=fixed(100), output_len=fixed(1))
    requests = make_requests(traffic, 3000, seed=1)
    result = simulate(Deployment(1, 1, ONE_PROMPT_PER_STEP, ONE_PROMPT_PER_STEP), profile, requests)
    ttfts = np.array(result.samples("ttft"))
    assert len(ttfts) == 3000 and ttfts.min() == pytest.approx(0.1)  # S, nothing else on an idle system
    assert ttfts.mean() - 0.1 == pytest.approx(0.05, rel=0.15)  # P-K mean wait at rho 0.5
    assert result.prefill_utilisation == pytest.approx(0.5, abs=0.03)


def test_simulated_prefill_admission_lets_one_prompt_at_a_time_reach_the_prefill_instance():
    # Four 100-token prompts at t = 0; one prefill step of any size takes 0.1 s. Unlimited,
    # the first starts a step alone and the other three share the next (TTFT 0.1, then
    # 0.2 s each); with one prefill slot per instance the gateway holds each back until the
    # one before has its first token: 0.1, 0.2, 0.3, 0.4 s.
    profile = synthetic_profile(prefill_intercept_s=0.1)
    shape = InstanceShape(max_num_seqs=64, max_num_batched_tokens=1000, num_kv_blocks=4096, max_model_len=512)
    requests = [SimRequest(f"r{i}", 0.0, list(range(1000 * i, 1000 * i + 100)), 1) for i in range(4)]
    unlimited = simulate(Deployment(1, 1, shape, shape), profile, requests, max_running_per_prefill=0)
    one_slot = simulate(Deployment(1, 1, shape, shape), profile, requests, max_running_per_prefill=1)
    assert sorted(unlimited.samples("ttft")) == pytest.approx([0.1, 0.2, 0.2, 0.2])
    assert sorted(one_slot.samples("ttft")) == pytest.approx([0.1, 0.2, 0.3, 0.4])


def test_simulated_decode_batch_obeys_littles_law():
    # TPOT fixed at 50 ms; 4 requests/s each in decode for 50 steps: B = 4 x 50 x 0.05 = 10.
    profile = synthetic_profile(prefill_per_token_s=1e-6, decode_intercept_s=0.05)
    traffic = Traffic(request_rate=4.0, input_len=fixed(32), output_len=fixed(51))
    batch, tpot = decode_batch(profile, 4.0, traffic)
    assert (batch, tpot) == (pytest.approx(10.0), pytest.approx(0.05))
    result = simulate(Deployment(1, 1), profile, make_requests(traffic, 800, seed=2))
    assert result.mean_decode_batch == pytest.approx(10.0, rel=0.1)
    assert result.percentile("tpot", 90) == pytest.approx(0.05)


def test_littles_law_with_a_batch_dependent_step():
    # TPOT = 10 ms + 2 ms x B, 5 req/s x 20 steps: B = 100 (0.01 + 0.002 B) -> B = 1 / (1 - 0.2) = 1.25.
    profile = synthetic_profile(decode_intercept_s=0.01, decode_per_seq_s=0.002)
    traffic = Traffic(request_rate=5.0, input_len=fixed(16), output_len=fixed(21))
    batch, tpot = decode_batch(profile, 5.0, traffic)
    assert batch == pytest.approx(1.25) and tpot == pytest.approx(0.0125)
    assert decode_batch(profile, 25.0, traffic) == (math.inf, math.inf)  # 500 x 0.002 >= 1: unstable


def known_answer_case(rate: float) -> tuple[Profile, Traffic, Slo, PlanOptions]:
    # Prefill S = 0.1 s per prompt (M/D/1); decode steps 20 ms whatever the batch.
    profile = synthetic_profile(prefill_per_token_s=0.001, decode_intercept_s=0.02)
    traffic = Traffic(request_rate=rate, input_len=fixed(100), output_len=fixed(11))
    slo = Slo(ttft_ms=300, tpot_ms=50)
    return profile, traffic, slo, PlanOptions(shape=ONE_PROMPT_PER_STEP, num_requests=1500, allow_colocated=False)


@pytest.fixture(scope="module")
def plan_at_15_per_s():
    """The known-answer case's plan at 15 req/s: seconds of simulation, deterministic (the
    requests are seeded), and only read by the tests that take it."""
    return Planner(*known_answer_case(15.0)).plan()


def test_plan_needs_enough_prefill_instances_to_keep_the_queue_short(plan_at_15_per_s):
    # 15 req/s x 0.1 s = 1.5 instances of work: P = 2 runs at rho 0.75 (M/D/1 p90 wait
    # ~0.33 s, TTFT over 300 ms), P = 3 at rho 0.5 (p90 wait ~0.12 s): 3 prefill. One
    # decode instance holds 15 x 10 x 0.02 = 3 requests (Little) at 20 ms < 50 ms.
    plan = plan_at_15_per_s
    assert plan.chosen.deployment.label() == "3P:1D"
    assert plan.guesses["disaggregated"].label() == "3P:1D"
    (fewer_prefill,) = [c for c in plan.smaller if c.deployment.num_prefill == 2]
    assert not fewer_prefill.meets(known_answer_case(15.0)[2])
    assert plan.chosen.simulated.mean_decode_batch == pytest.approx(3.0, rel=0.15)


def test_more_traffic_never_plans_fewer_instances():
    sizes = []
    for rate in (2.0, 6.0, 10.0, 15.0, 20.0, 25.0):
        profile, traffic, slo, options = known_answer_case(rate)
        plan = Planner(profile, traffic, slo, PlanOptions(shape=options.shape, num_requests=600)).plan()
        sizes.append(plan.chosen.deployment.num_instances)
    assert sizes == sorted(sizes), sizes
    assert sizes[0] < sizes[-1]


def test_light_traffic_plans_one_colocated_instance():
    # 0.5 req/s: one engine prefills (0.1 s) and decodes (20 ms steps) everything within
    # the SLO; disaggregated needs two instances.
    profile, traffic, slo, _ = known_answer_case(0.5)
    plan = Planner(profile, traffic, slo, PlanOptions(shape=ONE_PROMPT_PER_STEP, num_requests=300)).plan()
    assert plan.chosen.deployment.label() == "colocated x1"
    assert plan.chosen.predicted("tpot", 90) * 1000 <= slo.tpot_ms


def test_analytic_estimate_is_infinite_past_saturation():
    profile, traffic, slo, options = known_answer_case(15.0)
    assert analytic_estimate(profile, traffic, slo, Deployment(1, 1, options.shape, options.shape)).ttft_s == math.inf


def test_k8s_overlay_sets_replicas_and_hpa_bounds(plan_at_15_per_s):
    plan = plan_at_15_per_s
    files = k8s_overlay(plan, peak_factor=2.0)
    docs = [yaml.safe_load(text) for name, text in files.items() if name != "kustomization.yaml"]
    replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d in docs if d["kind"] == "Deployment"}
    bounds = {d["metadata"]["name"]: (d["spec"]["minReplicas"], d["spec"]["maxReplicas"])
              for d in docs if d["kind"] == "HorizontalPodAutoscaler"}
    assert replicas == {"pdserve-prefill": 3, "pdserve-decode": 1}
    assert bounds == {"pdserve-prefill": (3, 6), "pdserve-decode": (1, 2)}
    kustomization = yaml.safe_load(files["kustomization.yaml"])
    assert kustomization["resources"] == [".."]
    assert sorted(p["path"] for p in kustomization["patches"]) == sorted(set(files) - {"kustomization.yaml"})


def test_plan_command_writes_json_and_overlay(tmp_path, capsys):
    profile_path = tmp_path / "profile.json"
    synthetic_profile(prefill_per_token_s=0.001, decode_intercept_s=0.02).dump(profile_path)
    traffic_path = tmp_path / "traffic.json"
    traffic_path.write_text(json.dumps({"request_rate": 15, "input_len": {"low": 100, "high": 100},
                                        "output_len": {"low": 11, "high": 11}}))
    code = main(["--profile", str(profile_path), "--traffic", str(traffic_path), "--ttft-ms", "300",
                 "--tpot-ms", "50", "--max-num-batched-tokens", "100", "--num-kv-blocks", "4096",
                 "--no-colocated", "--num-requests", "1500", "--json", str(tmp_path / "plan.json"),
                 "--k8s-dir", str(tmp_path / "k8s")])
    assert code == 0
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["chosen"]["deployment"] == "3P:1D" and report["chosen"]["meets_slo"]
    assert any(not c["meets_slo"] for c in report["one_fewer"])
    assert (tmp_path / "k8s" / "hpa-prefill.yaml").exists() and (tmp_path / "k8s" / "deployment-decode.yaml").exists()


def test_traffic_schema_rejects_bad_input(tmp_path, capsys):
    with pytest.raises(ValueError):
        LengthRange(low=10, high=5)
    with pytest.raises(ValueError):
        Traffic(request_rate=0, input_len=fixed(1), output_len=fixed(1))
    profile_path = tmp_path / "profile.json"
    synthetic_profile().dump(profile_path)
    assert main(["--profile", str(profile_path), "--rate", "1", "--ttft-ms", "-5", "--tpot-ms", "1"]) == 2
    assert "ttft_ms" in capsys.readouterr().err


def test_validation_replays_the_traffic_with_bench_serve_flags():
    from bench.plan import bench_serve_args
    from bench.serve.main import build_parser
    traffic = Traffic(request_rate=0.5, input_len=LengthRange(low=128, high=384),
                      output_len=LengthRange(low=16, high=48))
    args = build_parser().parse_args(bench_serve_args(traffic, 60, seed=3))
    assert (args.random_input_len, args.random_output_len, args.random_range_ratio) == (256, 32, 0.5)
    assert (args.request_rate, args.num_prompts, args.seed) == ("0.5", 60, 3)
    # The same range as bench serve's random dataset draws: [L (1 - r), L (1 + r)].
    assert (math.floor(256 * 0.5), math.ceil(256 * 1.5)) == (128, 384)
    assert (math.floor(32 * 0.5), math.ceil(32 * 1.5)) == (16, 48)


def test_validation_takes_turns_and_reports_the_median(monkeypatch, tmp_path, plan_at_15_per_s):
    import bench.plan as plan_module
    profile, traffic, slo, options = known_answer_case(15.0)
    plan = plan_at_15_per_s
    order = []
    measured_p90 = {"3P:1D": [200.0, 260.0, 240.0], "2P:1D": [900.0, 700.0, 800.0], "3P:0D": []}

    def fake_stack(deployment, *args, **kwargs):
        # The stacks run the engine the profile measured: its dtype and threads.
        assert (kwargs["dtype"], kwargs["threads_per_instance"]) == (profile.engine.dtype,
                                                                     profile.machine.num_threads)
        label = deployment.label()
        order.append(label)
        ttft = measured_p90[label][sum(1 for x in order if x == label) - 1]
        return {"completed": 10, "failed": 0, **{f"p{p}_{m}_ms": ttft if m == "ttft" else 20.0
                                                 for m in ("ttft", "tpot") for p in (50, 90, 99)}}
    monkeypatch.setattr(plan_module, "measure_on_stack", fake_stack)
    rows = plan_module.validate(plan, profile, traffic, slo, options.shape, "1GiB", 10, 0, tmp_path, repeats=3)
    assert order == ["3P:1D", "2P:1D"] * 3  # turns: drifting load falls on both alike
    chosen, smaller = rows
    assert chosen["p90_ttft_ms"]["measured"] == 240.0 and chosen["measured_meets_slo"]
    assert smaller["p90_ttft_ms"]["measured"] == 800.0 and not smaller["measured_meets_slo"]
    predicted = chosen["p90_ttft_ms"]["predicted"]
    assert chosen["p90_ttft_error"] == pytest.approx(predicted / 240.0 - 1, abs=1e-3)


def test_colocated_overlay_empties_the_prefill_pool_and_drops_its_autoscaler():
    profile, traffic, slo, _ = known_answer_case(0.5)
    plan = Planner(profile, traffic, slo, PlanOptions(shape=ONE_PROMPT_PER_STEP, num_requests=300)).plan()
    files = k8s_overlay(plan, peak_factor=3.0)
    docs = [yaml.safe_load(text) for name, text in files.items() if name != "kustomization.yaml"]
    by_kind_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert by_kind_name[("Deployment", "pdserve-prefill")]["spec"]["replicas"] == 0
    assert by_kind_name[("HorizontalPodAutoscaler", "pdserve-prefill")]["$patch"] == "delete"
    assert by_kind_name[("HorizontalPodAutoscaler", "pdserve-decode")]["spec"] == {"minReplicas": 1, "maxReplicas": 3}


def test_validation_stacks_run_the_profiled_engine(monkeypatch, tmp_path):
    import bench.plan as plan_module
    import bench.serve.main as serve_main
    import common.cli.up as up_module
    profile, traffic, slo, options = known_answer_case(0.5)
    seen = {}

    class FakeStack:
        def __init__(self, num_prefill, num_decode, passthrough, **kwargs):
            seen["flags"] = list(passthrough)
            self.address = "127.0.0.1:1"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def fake_serve(argv):
        out = Path(argv[argv.index("--json") + 1])
        out.write_text(json.dumps({"runs": [{"completed": 1}]}))
        return 0

    monkeypatch.setattr(up_module, "LocalStack", FakeStack)
    monkeypatch.setattr(serve_main, "main", fake_serve)
    plan_module.measure_on_stack(Deployment(0, 1), traffic, options.shape, "1GiB", 5, 0, tmp_path,
                                 threads_per_instance=1, dtype="float32")
    flags = seen["flags"]
    # Without --num-threads, `up` gives a lone instance every core but the reserved one: faster than its profile.
    assert flags[flags.index("--num-threads") + 1] == "1"
    assert flags[flags.index("--dtype") + 1] == "float32"


def test_validation_predicts_each_runs_own_workload(monkeypatch, tmp_path, plan_at_15_per_s):
    import bench.plan as plan_module
    from bench.plan import make_requests
    profile, traffic, slo, options = known_answer_case(15.0)
    plan = plan_at_15_per_s
    monkeypatch.setattr(plan_module, "measure_on_stack", lambda *a, **k: {
        "completed": 10, "failed": 0, **{f"p{p}_{m}_ms": 100.0 for m in ("ttft", "tpot") for p in (50, 90, 99)}})
    rows = plan_module.validate(plan, profile, traffic, slo, options.shape, "1GiB", 10, 5, tmp_path, repeats=2)
    chosen = rows[0]
    # The runs' own 10 requests (seeds 5 and 6), not the plan's longer steady-state run.
    runs = [simulate(plan.chosen.deployment, profile, make_requests(traffic, 10, seed)) for seed in (5, 6)]
    want = float(np.median([r.percentile("ttft", 90) for r in runs])) * 1000
    assert chosen["p90_ttft_ms"]["predicted"] == pytest.approx(want, abs=0.1)
    assert chosen["p90_ttft_ms"]["predicted_steady"] == pytest.approx(plan.chosen.predicted("ttft", 90) * 1000,
                                                                       abs=0.1)
