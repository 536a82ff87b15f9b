"""`pdserve bench serve`: load-test a running gateway the way `vllm bench serve` does.

    pdserve bench serve --gateway 127.0.0.1:50051 --dataset-name random \\
        --random-input-len 256 --random-output-len 64 --num-prompts 50 \\
        --request-rate 1,2,4 --goodput ttft:2000 tpot:200 --json out.json --plot plots/
    pdserve bench serve --backend openai --base-url http://127.0.0.1:8000 --tokenizer bundled ...
                                        # the same workload over the OpenAI-compatible HTTP API
    pdserve bench serve --self-check    # the client's own streamed-token capacity

Metrics follow vLLM's definitions (see bench.serve.metrics). Exit status: 0
when the runs completed (failed requests are counted and reported), 1 when the
gateway could not be reached or a run completed no request, 2 on bad flags.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import sys

from bench.serve.arrivals import parse_rates
from bench.serve.datasets import (
    DATASETS,
    SHAREGPT_OUTPUT_LOGNORMAL,
    SHAREGPT_PROMPT_LOGNORMAL,
    Vocabulary,
    make_requests,
)
from bench.serve.metrics import format_report, parse_goodput
from common.service.flags import EnvDefaultsParser


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that name the API to drive and the server behind it (bench serve's and
    bench multi-turn's)."""
    parser.add_argument("--backend", choices=["grpc", "openai", "openai-chat"], default="grpc",
                        help="API to drive: grpc (GenerateStream), openai (POST /v1/completions, "
                             "streamed; any OpenAI-compatible server) or openai-chat (POST "
                             "/v1/chat/completions, each text prompt one user message)")
    parser.add_argument("--gateway", default="127.0.0.1:50051", help="grpc: gateway address HOST:PORT")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="openai, openai-chat: the server's URL (with or without /v1)")
    parser.add_argument("--model", default="", help="model name to send; empty: the served one")


def build_parser() -> argparse.ArgumentParser:
    parser = EnvDefaultsParser(prog="pdserve bench serve", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_flags(parser)
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=DATASETS, default="random")
    data.add_argument("--num-prompts", type=int, default=100, help="requests per request rate")
    data.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                      help="send token ids (exact lengths) or text")
    data.add_argument("--tokenizer", default=None,
                      help="'bundled' or a local HF directory: excludes all special ids and makes text "
                           "prompts exact; default: vocab size and EOS ids from the gateway's ModelInfo")
    data.add_argument("--max-model-len", type=int, default=None, help="default: the gateway's ModelInfo")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform on [L*(1-r), L*(1+r)], r in [0, 1)")
    data.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="sharegpt-like: fixed output length instead of the drawn ones")
    data.add_argument("--prefix-num-prefixes", type=int, default=10)
    data.add_argument("--prefix-len", type=int, default=256, help="prefix-repetition: shared prefix tokens")
    data.add_argument("--suffix-len", type=int, default=256, help="prefix-repetition: unique suffix tokens")
    data.add_argument("--output-len", type=int, default=128,
                      help="prefix-repetition: output tokens; json-schema: the most a request may take")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", default="inf",
                      help="requests/s, 'inf' for all at once; a comma list (1,2,4,8) sweeps them in turn")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of inter-arrival gaps: 1 Poisson, <1 burstier, >1 steadier")
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    load.add_argument("--seed", type=int, default=0,
                      help="seeds the dataset and the arrivals; each further rate of a sweep draws its "
                           "prompts with the next seed, so none is served from the prefix cache an "
                           "earlier rate filled")
    load.add_argument("--reuse-prompts", action="store_true",
                      help="every rate of a sweep sends the first rate's prompts (after the first "
                           "rate, prefix-cache hits)")
    load.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                      help="generate exactly the dataset's output lengths (default on)")
    load.add_argument("--request-timeout", type=float, default=None, help="per-request deadline, seconds")
    report = parser.add_argument_group("report")
    report.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="SLOs for goodput: ttft:MS tpot:MS e2el:MS (any subset)")
    report.add_argument("--metric-percentiles", default="90,99", help="percentiles to report")
    report.add_argument("--json", default=None, metavar="FILE", help="write every figure and the config")
    report.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts (needs matplotlib)")
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    check = parser.add_argument_group("client self-check")
    check.add_argument("--self-check", action="store_true",
                       help="only measure this client's streamed-token capacity against an in-process fake")
    check.add_argument("--self-check-requests", type=int, default=64)
    check.add_argument("--self-check-output-len", type=int, default=256)
    return parser


def load_vocabulary(args: argparse.Namespace, server_info: dict) -> Vocabulary:
    if args.tokenizer:
        from pathlib import Path

        from common.engine.model_files import resolve_model
        from common.text.prompt_tokenizer import load_prompt_tokenizer  # the gateway's: no torch import
        path = Path(args.tokenizer).expanduser()
        model_dir = path if (path / "tokenizer.json").is_file() else resolve_model(
            None if args.tokenizer == "bundled" else args.tokenizer)
        tokenizer = load_prompt_tokenizer(model_dir)
        special = (set(getattr(tokenizer, "all_special_ids", ())) | set(tokenizer.eos_token_ids)
                   | {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special})
        return Vocabulary(tokenizer.vocab_size, frozenset(special),
                          tokenizer if args.prompt_format == "text" else None)
    vocab_size = int(server_info.get("vocab_size") or 0)
    if vocab_size <= 0:
        raise ValueError("the server did not report a vocabulary size (the OpenAI API has no field "
                         "for it); pass --tokenizer bundled or a local HF directory")
    return Vocabulary(vocab_size, frozenset(int(i) for i in server_info.get("eos_token_ids", [])))


def dataset_options(args: argparse.Namespace, max_model_len: int | None) -> dict:
    common = dict(prompt_format=args.prompt_format, max_model_len=max_model_len)
    if args.dataset_name == "random":
        return dict(input_len=args.random_input_len, output_len=args.random_output_len,
                    range_ratio=args.random_range_ratio, **common)
    if args.dataset_name == "sharegpt-like":
        return dict(output_len=args.sharegpt_output_len, **common)
    if args.dataset_name == "json-schema":
        return dict(output_len=args.output_len, **common)
    return dict(prefix_len=args.prefix_len, suffix_len=args.suffix_len, num_prefixes=args.prefix_num_prefixes,
                output_len=args.output_len, **common)


def json_safe(value):
    """JSON has no inf: write it as the string "inf" (as --request-rate takes it)."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_outputs(args: argparse.Namespace, result: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(json_safe(result), f, indent=1)
        print(f"wrote {args.json}")
    if args.plot and result.get("runs"):
        from bench.serve.plots import write_plots
        for path in write_plots(result["runs"], args.plot):
            print(f"wrote {path}")


async def self_check(args: argparse.Namespace) -> int:
    from bench.fakes.fake_generate import measure_client_capacity
    figures = await measure_client_capacity(args.self_check_requests, args.self_check_output_len,
                                            args.max_concurrency or 32)
    print(f"client self-check: {figures['client_tokens_per_s']:.0f} streamed tokens/s over wall time, "
          f"{figures['tokens_per_cpu_s']:.0f} per CPU-second ({figures['total_output_tokens']} tokens, one "
          f"per message, {figures['num_requests']} requests; the fake GenerateService shares this process, "
          f"so both are lower bounds)")
    write_outputs(args, {"config": vars(args), "self_check": figures})
    return 0


def make_backend(args: argparse.Namespace, ignore_eos: bool, return_token_ids: bool = False,
                 request_id_prefix: str = "bench"):
    """The backend add_server_flags' flags name. return_token_ids: the completions API's
    chunks carry their token ids (vLLM's extension); request_id_prefix: gRPC request ids'."""
    from bench.serve.client import GrpcGenerateBackend, OpenAIChatBackend, OpenAICompletionsBackend
    if args.backend == "openai-chat":
        return OpenAIChatBackend(args.base_url, args.model, args.temperature, ignore_eos, args.request_timeout)
    if args.backend == "openai":
        return OpenAICompletionsBackend(args.base_url, args.model, args.temperature, ignore_eos,
                                        args.request_timeout, return_token_ids=return_token_ids)
    return GrpcGenerateBackend(args.gateway, args.model, args.temperature, ignore_eos, args.request_timeout,
                               request_id_prefix=request_id_prefix)


async def benchmark(args: argparse.Namespace) -> int:
    from bench.serve.client import describe_error, probe, run_benchmark
    from bench.serve.metrics import compute_metrics

    rates = parse_rates(args.request_rate)
    slos = parse_goodput(args.goodput)
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise ValueError("--num-prompts and --max-concurrency must be >= 1")
    if args.backend == "openai-chat" and args.prompt_format != "text":
        raise ValueError("--backend openai-chat sends messages of text: pass --prompt-format text")
    if args.dataset_name == "json-schema" and args.ignore_eos:
        raise ValueError("json-schema requests end when their JSON closes, at EOS: pass --no-ignore-eos")
    backend = make_backend(args, args.ignore_eos)
    async with backend:
        try:
            server_info = await backend.server_info() or {}
        except Exception as e:  # noqa: BLE001 -- gRPC or HTTP: either way nothing to measure
            target = f"gateway at {args.gateway}" if args.backend == "grpc" else f"server at {args.base_url}"
            print(f"pdserve bench serve: cannot reach the {target}: {describe_error(e)}", file=sys.stderr)
            return 1
        max_model_len = args.max_model_len or int(server_info.get("max_model_len") or 0) or None
        vocab = load_vocabulary(args, server_info)
        options = dataset_options(args, max_model_len)
        dataset_seeds = [args.seed if args.reuse_prompts else args.seed + i for i in range(len(rates))]
        request_sets = {seed: make_requests(args.dataset_name, args.num_prompts, vocab, seed, **options)
                        for seed in dict.fromkeys(dataset_seeds)}
        checked = await probe(backend, request_sets[args.seed][0])
        if not checked.success:
            print(f"pdserve bench serve: the probe request failed: {checked.error}", file=sys.stderr)
            return 1
        runs = []
        for rate, dataset_seed in zip(rates, dataset_seeds):
            requests = request_sets[dataset_seed]
            print(f"request rate {rate:g}/s, burstiness {args.burstiness:g}, "
                  f"max concurrency {args.max_concurrency or 'unlimited'}: {len(requests)} requests "
                  f"(dataset seed {dataset_seed})")
            outcomes, duration = await run_benchmark(backend, requests, rate, args.burstiness,
                                                     args.max_concurrency, args.seed, not args.disable_tqdm)
            metrics = compute_metrics(outcomes, duration, slos, percentiles)
            print(format_report(metrics, percentiles, f"Serving Benchmark Result ({rate:g} req/s)"))
            runs.append({"request_rate": rate, "burstiness": args.burstiness,
                         "max_concurrency": args.max_concurrency, "dataset_seed": dataset_seed, **metrics})
    requests = [r for request_set in request_sets.values() for r in request_set]
    prompt_lens = [r.prompt_len for r in requests]
    output_lens = [r.output_len for r in requests]
    config = {**vars(args), "request_rates": rates, "goodput_slos_ms": slos, "percentiles": percentiles,
              "max_model_len_used": max_model_len, "server_info": server_info,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "dataset": {"name": args.dataset_name, "num_requests": len(request_sets[args.seed]),
                          "seeds": list(request_sets),
                          "mean_prompt_len": sum(prompt_lens) / len(requests),
                          "mean_output_len": sum(output_lens) / len(requests),
                          "prompt_lens_exact": args.prompt_format == "ids" or vocab.tokenizer is not None,
                          "vocab_size": vocab.size, "num_excluded_special_ids": len(vocab.special_ids)}}
    if args.dataset_name == "sharegpt-like":
        config["dataset"]["lognormal_mu_sigma"] = {"prompt": SHAREGPT_PROMPT_LOGNORMAL,
                                                   "output": SHAREGPT_OUTPUT_LOGNORMAL}
    write_outputs(args, {"config": config, "runs": runs})
    return 0 if all(run["completed"] for run in runs) else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.plot:  # fail before a long run, not after it
            import importlib.util
            if importlib.util.find_spec("matplotlib") is None:
                raise ValueError("--plot needs matplotlib: pip install 'pdserve[bench]' (matplotlib==3.11.2)")
        return asyncio.run(self_check(args) if args.self_check else benchmark(args))
    except ValueError as e:
        print(f"pdserve bench serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
