"""`pdserve` command line. Each flag can also be set as PDSERVE_<FLAG> in the environment."""
from __future__ import annotations

import argparse
import os
import sys

from common.engine.process_exit import skip_collection_at_exit

# `pdserve up` forks its services (Popen with preexec_fn) from a process that runs
# gRPC; gRPC's fork handlers then abort in the child's poller ("epoll: bad fd").
# Nothing here relies on gRPC surviving a fork, so switch them off before gRPC loads.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def build_parser() -> argparse.ArgumentParser:
    """Only for `pdserve --help` and unknown commands: every command parses its own flags."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    for name, (module, text) in DELEGATED.items():
        sub.add_parser(name, help=text, add_help=False)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for name, (module, text) in DELEGATED_BENCH.items():
        bench.add_parser(name, help=text, add_help=False)
    return parser


# Commands whose modules own their flags (and their --help): `pdserve NAME ...`.
DELEGATED = {
    "generate-offline": ("common.cli.generate_offline", "complete a prompt in this process, no services"),
    "gateway": ("gateway.main", "run the gateway (public Generate API, registry, placement)"),
    "prefill": ("prefill_service.main", "run a prefill instance"),
    "decode": ("decode_service.main", "run a decode instance"),
    "up": ("common.cli.up", "run a local stack: gateway + N prefill + M decode processes"),
    "generate": ("common.cli.generate", "send a prompt to a gateway and print the completion"),
    "health": ("common.cli.health", "exit 0 only if ADDR reports SERVING (grpc.health.v1)"),
    "tune": ("bench.tune", "search engine settings for the best throughput within TTFT/TPOT limits"),
    "profile": ("bench.profile", "record this machine's prefill, decode and KV transfer times as JSON"),
    "plan": ("bench.plan", "the cheapest prefill:decode (or colocated) instance counts that meet SLOs"),
}
DELEGATED_BENCH = {
    "offline": ("bench.offline", "LLM.generate vs Hugging Face generate and vLLM's CPU build"),
    "serve-peer": ("bench.peers.vllm_serve", "pdserve vs `vllm serve` under the same load and client"),
    "serve-embed": ("bench.peers.vllm_serve_embed", "/v1/embeddings served: pdserve vs `vllm serve --runner pooling`"),
    "transfer": ("bench.transfer", "KV transfer throughput vs plain pyzmq"),
    "cpu-attention": ("bench.cpu_attention", "one layer's CPU paged attention: torch path vs the native kernel"),
    "decode-linears": ("bench.decode_linears", "a decode step's linears: oneDNN, F.linear, the native GEMVs"),
    "serve": ("bench.serve.main",
              "load-test a gateway: TTFT/TPOT/ITL/E2EL, throughput, goodput (vLLM definitions)"),
    "multi-turn": ("bench.multi_turn",
                   "chat conversations whose prompts grow turn by turn: TTFT per turn, prefix-cache share"),
    "routing": ("bench.routing",
                "placement policies on a real stack: prefill prefix-cache hit rates and TTFT"),
    "disagg": ("bench.disagg",
               "disaggregated vs colocated serving on a real stack: ITL, TPOT, TTFT, goodput"),
    "spec": ("bench.spec", "speculative decoding per proposer: copy-heavy, chat and random workloads"),
    "scheduler-steps": ("bench.scheduler_steps", "greedy decode tokens/s at each --num-scheduler-steps, in turns"),
    "sampling": ("bench.sampling", "random sampling's cost: the sampler's native ops against their torch forms"),
    "embed": ("bench.embed", "embeddings offline: LLM.embed vs vLLM's pooling runner, prompts/s and agreement"),
    "lora": ("bench.lora", "LoRA adapters offline: output tok/s with none, one and two adapters vs the base engine"),
    "quant": ("bench.quant", "quantized weights (gguf Q4_1, int8) vs dense fp32/bf16: decode speed, agreement, ppl"),
    "structured": ("bench.structured", "JSON-schema constrained generation: validity and throughput vs unconstrained"),
    "overhead": ("bench.overhead", "the gateway's own cost per token, against a fake decode instance"),
    "executor": ("bench.executor_overhead", "the multi-process executor's cost per step at TP 1, against uni"),
    "chaos": ("bench.chaos", "fault injection on a real stack: kills, stops, drains, restarts, scaling, abort storm"),
    "bounds": ("bench.bounds", "what a request at the documented bounds costs a normal request beside it"),
    "overload": ("bench.overload", "offered load past capacity: completed, refused (429) and failed, latency"),
    "pipeline": ("bench.pipeline", "pipeline parallelism: one batch per stage in flight vs one at a time vs one rank"),
    "startup": ("bench.startup", "start-up to the first token, cold and with the caches: offline and a local stack"),
    "placement-sim": ("bench.placement_sim",
                      "placement policies in simulation: prefix-cache hit rates against an oracle"),
}


def _delegated_module(argv: list[str]) -> tuple[str, list[str]] | None:
    if argv and argv[0] in DELEGATED:
        return DELEGATED[argv[0]][0], argv[1:]
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in DELEGATED_BENCH:
        return DELEGATED_BENCH[argv[1]][0], argv[2:]
    return None


def main(argv: list[str] | None = None) -> int:
    own_command_line = argv is None  # this process's command: it exits once the command returns
    argv = sys.argv[1:] if argv is None else argv
    delegated = _delegated_module(argv)
    if delegated is not None:
        import importlib
        module, rest = delegated
        code = importlib.import_module(module).main(rest) or 0
        if own_command_line:  # this process exits next
            skip_collection_at_exit()
        return code
    build_parser().parse_args(argv)  # prints help or the error, and exits
    return 2


if __name__ == "__main__":
    sys.exit(main())
