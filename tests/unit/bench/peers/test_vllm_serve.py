"""serve-peer's comparison rows: each rate's throughput ratio beside both sides' TPOT and TTFT;
the client's load, sampling temperature included, the same for both servers."""
from __future__ import annotations

import argparse
import itertools
import time

import pytest

from bench.peers.vllm_serve import client_argv, compare, median_rows, resolve_dtype
from bench.serve.main import build_parser as serve_parser


def _run(rate: float, tok_s: float, tpot: float, ttft: float) -> dict:
    return {"request_rate": rate, "output_throughput": tok_s, "p99_tpot_ms": tpot, "mean_ttft_ms": ttft,
            "p99_ttft_ms": 2 * ttft, "failed": 0}


def test_rows_pair_the_runs_rate_by_rate():
    ours = {"runs": [_run(1, 62.0, 20.0, 160.0), _run(4, 231.0, 46.0, 210.0)]}
    peer = {"runs": [_run(1, 60.0, 35.0, 265.0), _run(4, 154.0, 137.0, 648.0)]}
    rows = compare(ours, peer)
    assert [row["request_rate"] for row in rows] == [1, 4]
    assert rows[1]["throughput_ratio"] == pytest.approx(1.5)
    assert (rows[1]["pdserve_p99_tpot_ms"], rows[1]["vllm_p99_tpot_ms"]) == (46.0, 137.0)
    assert (rows[0]["pdserve_mean_ttft_ms"], rows[0]["vllm_mean_ttft_ms"]) == (160.0, 265.0)
    assert (rows[0]["pdserve_p99_ttft_ms"], rows[0]["vllm_p99_ttft_ms"]) == (320.0, 530.0)


def test_rounds_give_each_figure_its_median_and_keep_every_round_ratio():
    rounds = [compare({"runs": [_run(1, 60.0, 20.0, 100.0)]}, {"runs": [_run(1, 50.0, 40.0, 200.0)]}),
              compare({"runs": [_run(1, 30.0, 90.0, 300.0)]}, {"runs": [_run(1, 40.0, 30.0, 150.0)]}),
              compare({"runs": [_run(1, 62.0, 25.0, 120.0)]}, {"runs": [_run(1, 45.0, 50.0, 250.0)]})]
    rounds[1][0]["pdserve_failed"] = 2
    [row] = median_rows(rounds)
    assert row["request_rate"] == 1
    assert (row["pdserve_output_tokens_per_s"], row["vllm_output_tokens_per_s"]) == (60.0, 45.0)
    assert row["throughput_ratio"] == pytest.approx(60.0 / 45.0)  # of the medians, not a median of ratios
    assert row["round_throughput_ratios"] == pytest.approx([1.2, 0.75, 62.0 / 45.0])
    assert (row["pdserve_p99_tpot_ms"], row["vllm_p99_tpot_ms"]) == (25.0, 40.0)
    assert (row["pdserve_mean_ttft_ms"], row["vllm_p99_ttft_ms"]) == (120.0, 400.0)
    assert (row["pdserve_failed"], row["vllm_failed"]) == (2, 0)  # summed: a failure in any round shows


def test_repeats_below_one_are_refused(capsys):
    from bench.peers.vllm_serve import main
    with pytest.raises(SystemExit) as stopped:
        main(["--repeats", "0"])
    assert stopped.value.code == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_a_negative_idle_window_is_refused(capsys):
    from bench.peers.vllm_serve import main
    with pytest.raises(SystemExit) as stopped:
        main(["--idle-seconds", "-1"])
    assert stopped.value.code == 2
    assert "--idle-seconds must be 0 or more" in capsys.readouterr().err


def test_the_client_sends_the_temperature_given_and_bench_serve_takes_its_flags(tmp_path):
    args = argparse.Namespace(random_input_len=256, random_output_len=64, random_range_ratio=0.5, num_prompts=8,
                              request_rate="1,2", seed=3, temperature=0.8, workload="random")
    argv = client_argv("http://127.0.0.1:8000", args, tmp_path / "out.json")
    assert argv[argv.index("--temperature") + 1] == "0.8"
    parsed = serve_parser().parse_args(argv[argv.index("serve") + 1:])
    assert (parsed.temperature, parsed.num_prompts, parsed.seed, parsed.model) == (0.8, 8, 3, "")
    with_adapter = client_argv("http://127.0.0.1:8000", args, tmp_path / "out.json", "bench-lora")
    assert serve_parser().parse_args(with_adapter[with_adapter.index("serve") + 1:]).model == "bench-lora"


def test_a_bad_speculative_config_stops_before_either_server_starts(capsys):
    from bench.peers.vllm_serve import main
    with pytest.raises(SystemExit) as stopped:
        main(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": "4"}'])
    assert stopped.value.code == 2
    assert "num_speculative_tokens: Input should be a valid integer" in capsys.readouterr().err


def test_the_prefill_queue_limit_reaches_our_gateway_only_and_only_when_set():
    from bench.peers.vllm_serve import our_flags
    from common.cli.up import route_flags
    args = argparse.Namespace(dtype="float32", kv_cache_memory="2GiB", max_model_len=2048, kv_cache_dtype="auto",
                              enforce_eager=False, num_scheduler_steps=1, max_prefill_queue_tokens=1024,
                              speculative_config=None, lora_path=None)
    routed = route_flags(our_flags(args, "/models/m"))
    assert routed["gateway"][routed["gateway"].index("--max-prefill-queue-tokens") + 1] == "1024"
    assert "--max-prefill-queue-tokens" not in routed["prefill"] + routed["decode"]
    assert routed["decode"][routed["decode"].index("--dtype") + 1] == "float32"
    args.max_prefill_queue_tokens = 0
    assert "--max-prefill-queue-tokens" not in our_flags(args, "/models/m")


def _turn_record(ttfts_by_turn: list[float], cached: int, completed: int = 4) -> dict:
    """A bench multi-turn record: `completed` conversations, each turn's mean TTFT given,
    every prompt 100 tokens with `cached` of them found cached."""
    by_turn = [{"turn": k + 1, "completed": completed, "mean_ttft_ms": ttft} for k, ttft in enumerate(ttfts_by_turn)]
    turns = [{"turn": k + 1, "prompt_len": 100, "num_cached_tokens": cached, "error": ""}
             for k in range(len(ttfts_by_turn)) for _ in range(completed)]
    return {"metrics": {"output_throughput": 200.0, "p99_tpot_ms": 12.0, "mean_ttft_ms": 90.0, "p99_ttft_ms": 300.0,
                        "failed": 0, "completed": completed * len(ttfts_by_turn), "duration": 10.0},
            "by_turn": by_turn, "turns": turns}


def test_a_multi_turn_run_gives_its_later_turns_ttft_and_cached_share():
    from bench.peers.vllm_serve import multi_turn_run
    run = multi_turn_run(_turn_record([300.0, 60.0, 80.0], cached=40), max_concurrency=4)
    assert run["max_concurrency"] == 4 and run["output_throughput"] == 200.0
    assert run["later_turns_mean_ttft_ms"] == pytest.approx(70.0)  # turns 2 and 3 only
    assert run["cached_share"] == pytest.approx(0.4)
    assert multi_turn_run(_turn_record([300.0, 60.0], cached=0), 1)["cached_share"] is None  # the server did not say


def test_multi_turn_rows_pair_by_concurrency_and_a_missing_figure_stays_missing():
    from bench.peers.vllm_serve import format_row, multi_turn_run
    ours = {"runs": [multi_turn_run(_turn_record([300.0, 60.0], cached=40), 1)]}
    peer = {"runs": [multi_turn_run(_turn_record([400.0, 120.0], cached=0), 1)]}
    peer["runs"][0]["output_throughput"] = 160.0
    [row] = median_rows([compare(ours, peer), compare(ours, peer)])
    assert row["max_concurrency"] == 1 and "request_rate" not in row
    assert row["throughput_ratio"] == pytest.approx(1.25)
    assert (row["pdserve_later_turns_mean_ttft_ms"], row["vllm_later_turns_mean_ttft_ms"]) == (60.0, 120.0)
    assert (row["pdserve_cached_share"], row["vllm_cached_share"]) == (pytest.approx(0.4), None)
    text = format_row(row, repeats=2)
    assert text.startswith("  1 open") and "60.0 vs 120.0 ms" in text and "0.400 vs -" in text


def test_the_multi_turn_client_takes_its_flags_and_each_concurrency_gets_its_own_conversations(tmp_path):
    from bench.multi_turn import build_parser as multi_turn_parser
    from bench.peers.vllm_serve import main, multi_turn_argv
    args = argparse.Namespace(num_conversations=8, turns=3, think_time=0.5, temperature=0.0, workload="multi-turn")
    argv = multi_turn_argv("http://127.0.0.1:8000", args, tmp_path / "out.json", 4, seed=7)
    parsed = multi_turn_parser().parse_args(argv[argv.index("multi-turn") + 1:])
    assert (parsed.backend, parsed.base_url, parsed.max_concurrency, parsed.seed) == (
        "openai", "http://127.0.0.1:8000", 4, 7)
    args.workload = "multi-turn-chat"
    argv = multi_turn_argv("http://127.0.0.1:8000", args, tmp_path / "out.json", 4, seed=7)
    assert multi_turn_parser().parse_args(argv[argv.index("multi-turn") + 1:]).backend == "openai-chat"
    assert (parsed.num_conversations, parsed.turns, parsed.think_time, parsed.tokenizer) == (8, 3, 0.5, "bundled")
    with pytest.raises(SystemExit) as stopped:
        main(["--workload", "multi-turn", "--max-concurrency", "1,0"])
    assert stopped.value.code == 2


def test_vllm_reports_cached_tokens_for_multi_turn_and_takes_the_block_size_given():
    from pathlib import Path

    from bench.peers.vllm_serve import vllm_argv
    args = argparse.Namespace(dtype="bfloat16", max_model_len=2048, seed=0, kv_cache_dtype="auto",
                              speculative_config=None, lora_path=None, peer_block_size=None, workload="random")
    argv = vllm_argv(args, "/models/m", Path("/venv/bin/python"), 8000)
    assert "--block-size" not in argv and "--enable-prompt-tokens-details" not in argv
    args.workload, args.peer_block_size = "multi-turn", 16
    argv = vllm_argv(args, "/models/m", Path("/venv/bin/python"), 8000)
    assert argv[argv.index("--block-size") + 1] == "16" and "--enable-prompt-tokens-details" in argv
    assert argv[argv.index("--port") + 1] == "8000"


def test_a_server_that_exits_before_serving_shows_the_end_of_its_log(tmp_path):
    import sys

    from bench.peers.vllm_serve import free_port, serving
    argv = [sys.executable, "-c", "print('loading'); print('ValueError: block_size 16 is not supported'); "
                                  "raise SystemExit(1)"]
    with pytest.raises(RuntimeError) as failed:
        with serving(argv, free_port(), tmp_path / "serve.log", {}, startup_timeout_s=30):
            pass
    assert "exited with 1 before serving" in str(failed.value)
    assert "ValueError: block_size 16 is not supported" in str(failed.value)


def test_the_json_schema_workload_sends_text_prompts_that_end_at_eos(tmp_path):
    args = argparse.Namespace(random_input_len=256, random_output_len=96, random_range_ratio=0.5, num_prompts=8,
                              request_rate="1,2", seed=3, temperature=0.0, workload="json-schema")
    argv = client_argv("http://127.0.0.1:8000", args, tmp_path / "out.json")
    parsed = serve_parser().parse_args(argv[argv.index("serve") + 1:])
    assert (parsed.dataset_name, parsed.prompt_format, parsed.ignore_eos, parsed.output_len) == (
        "json-schema", "text", False, 96)


def test_a_multi_turn_run_with_failed_turns_is_counted_and_one_without_a_record_stops(tmp_path, monkeypatch):
    import json
    import subprocess

    from bench.peers import vllm_serve
    args = argparse.Namespace(num_conversations=2, turns=2, think_time=0.0, temperature=0.0, workload="multi-turn",
                              lora_path=None, max_concurrency=[1, 4], seed=0, idle_seconds=0.0)
    record = _turn_record([300.0, 60.0], cached=40, completed=2)
    record["metrics"]["failed"] = 1
    calls = []

    def client(argv, **kwargs):  # the client process, which exits 1 when a turn failed
        calls.append(argv)
        out = argv[argv.index("--json") + 1]
        if argv[argv.index("--max-concurrency") + 1] == "1":
            with open(out, "w") as f:
                json.dump(record, f)
        return subprocess.CompletedProcess(argv, 1)
    monkeypatch.setattr(vllm_serve.subprocess, "run", client)
    with pytest.raises(RuntimeError, match="at 4 open exited 1 without a record"):
        vllm_serve.run_client("http://127.0.0.1:8000", args, tmp_path / "ours.json", [])
    args.max_concurrency = [1]
    [run] = vllm_serve.run_client("http://127.0.0.1:8000", args, tmp_path / "ours.json", [])["runs"]
    assert (run["max_concurrency"], run["failed"], run["completed"]) == (1, 1, 4)


def test_a_client_record_carries_the_steal_and_the_servers_cpu_under_load_and_idle(monkeypatch, tmp_path):
    import subprocess
    import sys

    from bench.peers import vllm_serve
    from bench.peers import proc_cpu
    readings = itertools.chain([10.0, 10.75], itertools.repeat(11.0))  # the load's steal, then none
    monkeypatch.setattr(proc_cpu, "host_steal_seconds", lambda: next(readings))
    # The "server": a real child that spins, and one that sleeps, while the stub load runs.
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    load_wall_s = 1.0

    def load(base_url, args, json_path):
        deadline = time.monotonic() + load_wall_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
        return {"runs": []}

    monkeypatch.setattr(vllm_serve, "_run_client", load)
    try:
        record = vllm_serve.run_client("http://127.0.0.1:1", argparse.Namespace(idle_seconds=1.0),
                                       tmp_path / "out.json", [spinner.pid, sleeper.pid])
        quiet = vllm_serve.run_client("http://127.0.0.1:1", argparse.Namespace(idle_seconds=1.0),
                                      tmp_path / "out.json", [sleeper.pid])
    finally:
        spinner.kill()
        sleeper.kill()
        spinner.wait(timeout=30)
        sleeper.wait(timeout=30)
    assert record["host_steal_s"] == 0.75 and record["runs"] == []
    # One spinning thread over a 1 s load: up to a second of CPU (less where the loaded host
    # starves it), never more; the sleeper adds nothing.
    assert 0.1 <= record["server_cpu_s"] <= load_wall_s + 0.1
    # Left alone afterwards, the spinner keeps a core busy (up to one), the sleeper none.
    assert 0.1 <= record["idle_cpu_cores"] <= 1.1
    assert quiet["server_cpu_s"] < 0.05 and quiet["idle_cpu_cores"] < 0.05


def test_the_summary_line_gives_each_sides_cpu_and_steal_round_by_round():
    from bench.peers.vllm_serve import format_cpu_and_steal
    line = format_cpu_and_steal({"server_cpu_s": {"pdserve": [44.74, 44.27], "vllm": [84.08, 84.37]},
                                 "host_steal_s": {"pdserve": [0.51, 0.5], "vllm": [1.26, 2.39]}})
    assert line == ("server CPU s: pdserve 44.7 / 44.3 | vllm 84.1 / 84.4; "
                    "host steal s: pdserve 0.5 / 0.5 | vllm 1.3 / 2.4")
    idle = format_cpu_and_steal({"server_cpu_s": {"pdserve": [1.0], "vllm": [2.0]},
                                 "host_steal_s": {"pdserve": [0.0], "vllm": [0.0]},
                                 "idle_cpu_cores": {"pdserve": [0.012], "vllm": [0.31]}})
    assert idle.endswith("; idle, cores busy: pdserve 0.01 | vllm 0.31")


@pytest.mark.parametrize("native_bf16, want", [(True, "bfloat16"), (False, "float32")])
def test_dtype_auto_names_our_engines_choice_for_both_servers(monkeypatch, native_bf16, want):
    # vLLM's own auto would take the checkpoint's bf16, emulated on a CPU without native bf16.
    import common.engine.device as device
    monkeypatch.delenv("PDSERVE_DTYPE", raising=False)
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda flags=None: native_bf16)
    assert resolve_dtype("auto") == want
    assert resolve_dtype("float16") == "float16"  # a named dtype goes to both as it is
