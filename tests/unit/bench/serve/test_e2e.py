"""`pdserve bench serve` end to end over real gRPC on loopback: against the in-process
fake GenerateService (JSON with every key, plots, failures counted), the client
self-check, and once against the real gateway with a fake decode instance."""
from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest

from bench.fakes.fake_generate import FakeGenerateService
from bench.serve.main import benchmark, build_parser, main

RUN_KEYS = {"request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
            "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
            "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
            "max_concurrent_requests", "input_lens", "output_lens", "start_times", "ttfts", "tpots",
            "e2els", "itls", "errors"}
for _name in ("ttft", "tpot", "itl", "e2el"):
    RUN_KEYS |= {f"{stat}_{_name}_ms" for stat in ("mean", "median", "std", "p90", "p99")}


def run_against_fake(argv: list[str], **fake_options) -> tuple[int, FakeGenerateService]:
    async def scenario():
        async with FakeGenerateService(**fake_options) as fake:
            args = build_parser().parse_args(["--gateway", fake.address, "--disable-tqdm", *argv])
            return await benchmark(args), fake
    return asyncio.run(scenario())


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One two-rate sweep against a fake that fails every 5th call; --plot when matplotlib is here."""
    tmp = tmp_path_factory.mktemp("sweep")
    plot_args = ["--plot", str(tmp / "plots")] if importlib.util.find_spec("matplotlib") else []
    rc, fake = run_against_fake(
        ["--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "6",
         "--num-prompts", "12", "--request-rate", "200,inf", "--max-concurrency", "8", "--seed", "3",
         "--goodput", "ttft:5000", "tpot:5000", "--json", str(tmp / "result.json"), *plot_args],
        first_token_delay_s=0.02, delay_s=0.002, fail_every=5)
    return rc, fake, tmp


def test_sweep_writes_json_with_every_figure(sweep):
    rc, fake, tmp = sweep
    assert rc == 0
    result = json.loads((tmp / "result.json").read_text())
    config, runs = result["config"], result["runs"]
    assert config["dataset_name"] == "random" and config["request_rates"] == [200.0, "inf"]
    assert config["goodput_slos_ms"] == {"ttft": 5000.0, "tpot": 5000.0}
    assert config["server_info"]["vocab_size"] == 1000 and config["max_model_len_used"] == 4096
    assert [run["request_rate"] for run in runs] == [200.0, "inf"]
    for run in runs:
        assert RUN_KEYS <= set(run), RUN_KEYS - set(run)
    # The fake fails calls 5, 10, 15, 20, 25; call 1 was the probe, run 1 is calls 2-13.
    assert [(run["completed"], run["failed"]) for run in runs] == [(10, 2), (9, 3)]
    for run in runs:
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])
        assert set(run["output_lens"]) == {0, 6} and run["total_input_tokens"] == 16 * run["completed"]
        assert all(e.startswith("UNAVAILABLE: injected failure") for e in run["errors"] if e)
        assert run["median_ttft_ms"] >= 20 and run["median_itl_ms"] >= 2 and run["median_tpot_ms"] >= 2
    # What went on the wire: the dataset's ids and lengths, greedy, ignore_eos, unique ids.
    sent = fake.servicer.requests[1:]
    assert {len(r.token_ids.ids) for r in sent} == {16}
    assert {(r.sampling.max_tokens, r.sampling.ignore_eos, r.sampling.temperature) for r in sent} == {(6, True, 0.0)}
    assert len({r.request_id for r in fake.servicer.requests}) == 25
    # Each rate draws its own prompts (seed 3, then 4): none of the first rate's comes again,
    # where the prefix cache it filled would serve it.
    assert [run["dataset_seed"] for run in runs] == [3, 4] and config["dataset"]["seeds"] == [3, 4]
    first, second = ({tuple(r.token_ids.ids) for r in sent[i:i + 12]} for i in (0, 12))
    assert len(first) == len(second) == 12 and not first & second


def test_reuse_prompts_sends_the_first_rates_prompts_at_every_rate(tmp_path):
    rc, fake = run_against_fake(["--random-input-len", "16", "--random-output-len", "2", "--num-prompts", "5",
                                 "--request-rate", "inf,inf", "--reuse-prompts", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    sent = [tuple(r.token_ids.ids) for r in fake.servicer.requests[1:]]
    assert len(sent) == 10 and sorted(sent[:5]) == sorted(sent[5:])
    assert [run["dataset_seed"] for run in json.loads((tmp_path / "r.json").read_text())["runs"]] == [0, 0]


def test_sweep_writes_plots(sweep):
    pytest.importorskip("matplotlib")  # the optional `bench` extra
    _, _, tmp = sweep
    for name in ("latency_cdf.png", "throughput_vs_rate.png"):
        assert (tmp / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_self_check_reports_client_capacity(tmp_path, capsys):
    out = tmp_path / "self_check.json"
    assert main(["--self-check", "--self-check-requests", "16", "--self-check-output-len", "128",
                 "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["self_check"]
    assert figures["failed"] == 0 and figures["total_output_tokens"] == 16 * 128
    # ~9000 per CPU-second here; 10x the real stack's ~200 tokens/s is the floor we need.
    # Per CPU-second, because wall-time rates fall when other work shares the machine.
    assert figures["tokens_per_cpu_s"] > 2000 and figures["client_tokens_per_s"] > 0
    assert "streamed tokens/s" in capsys.readouterr().out


def test_errors_exit_codes(capsys):
    assert main(["--request-rate", "0"]) == 2
    assert main(["--gateway", "127.0.0.1:1", "--num-prompts", "1", "--disable-tqdm"]) == 1
    assert "cannot reach the gateway" in capsys.readouterr().err


def test_against_real_gateway_with_fake_decode(tmp_path):
    from gateway.core import GatewaySettings
    from tests.support.background_gateway import BackgroundGateway

    out = tmp_path / "gateway.json"
    with BackgroundGateway(GatewaySettings(policy="round_robin")) as gw:
        gw.add_fake_decode("decode-0", token_ids=list(range(1000, 1010)), delay_s=0.001)
        rc = main(["--gateway", gw.address, "--dataset-name", "prefix-repetition", "--prefix-len", "32",
                   "--suffix-len", "8", "--prefix-num-prefixes", "2", "--output-len", "5",
                   "--num-prompts", "6", "--request-rate", "100", "--disable-tqdm", "--json", str(out)])
    assert rc == 0
    run = json.loads(out.read_text())["runs"][0]
    assert (run["completed"], run["failed"]) == (6, 0)
    assert run["output_lens"] == [5] * 6 and run["total_input_tokens"] == 6 * 40


def test_json_schema_requests_reach_decode_constrained_over_both_apis(tmp_path):
    from bench.structured import SCHEMAS
    from gateway.core import GatewaySettings
    from gateway.openai_api.server import OpenAIServer
    from tests.support.background_gateway import BackgroundGateway

    dataset = ["--dataset-name", "json-schema", "--prompt-format", "text", "--tokenizer", "bundled",
               "--output-len", "5", "--num-prompts", "3", "--request-rate", "100", "--disable-tqdm"]
    # Honouring EOS is the point of a constrained request: it ends when its JSON closes.
    assert main(["--gateway", "127.0.0.1:1", *dataset]) == 2
    with BackgroundGateway(GatewaySettings()) as gw:
        fake = gw.add_fake_decode("decode-0", token_ids=list(range(1000, 1010)))
        server = gw.call(lambda: OpenAIServer(gw.gateway, port=0))
        http_address = gw.call(server.start())
        try:
            assert main(["--gateway", gw.address, "--no-ignore-eos", *dataset]) == 0
            assert main(["--backend", "openai", "--base-url", f"http://{http_address}/v1", "--no-ignore-eos",
                         *dataset]) == 0
        finally:
            gw.call(server.stop())
        sent = [(json.loads(r.sampling.structured_output.json), r.sampling.ignore_eos)
                for r in fake.servicer.requests if r.sampling.HasField("structured_output")]
    # Each API: a probe (unconstrained), then the three requests, one schema each in turn.
    assert sent == [(SCHEMAS[0], False), (SCHEMAS[1], False), (SCHEMAS[2], False)] * 2


def test_the_chat_backend_sends_each_text_prompt_as_one_user_message(tmp_path):
    from tests.unit.gateway.openai_api.test_server import http_gateway

    load = ["--backend", "openai-chat", "--tokenizer", "bundled", "--random-input-len", "12",
            "--random-output-len", "4", "--num-prompts", "3", "--request-rate", "100", "--disable-tqdm"]
    assert main([*load, "--prompt-format", "ids"]) == 2  # a token-id prompt is no message
    out = tmp_path / "chat.json"
    with http_gateway(token_ids=list(range(1000, 1010))) as gw:
        rc = main([*load, "--base-url", f"http://{gw.http_address}", "--prompt-format", "text", "--json", str(out)])
        prompts = [list(r.prompt_token_ids) for r in gw.fake.servicer.requests]
    assert rc == 0
    run = json.loads(out.read_text())["runs"][0]
    assert (run["completed"], run["failed"], run["output_lens"]) == (3, 0, [4, 4, 4])
    from common.engine.model_files import resolve_model
    from common.text.tokenizer import load_tokenizer
    # Each one a chat, the prompt its user turn (the probe's first): the template's roles around
    # it (decoded without the special tokens that open each turn).
    texts = [load_tokenizer(resolve_model(None)).decode(p) for p in prompts]
    assert len(texts) == 4 and all("\nuser\n" in t and t.endswith("\nassistant\n") for t in texts)
