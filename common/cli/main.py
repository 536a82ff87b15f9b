"""`pdserve` command line. Each flag can also be set as PDSERVE_<FLAG> in the environment."""
from __future__ import annotations

import argparse
import logging
import os
import sys

# `pdserve up` forks its services (Popen with preexec_fn) from a process that runs
# gRPC; gRPC's fork handlers then abort in the child's poller ("epoll: bad fd").
# Nothing here relies on gRPC surviving a fork, so switch them off before gRPC loads.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


class EnvDefaultsParser(argparse.ArgumentParser):
    """Flags take their default from PDSERVE_<FLAG_NAME> when that variable is set.

    Applied when parsing (and for --help) rather than in add_argument, so flags added
    through argument groups (whose add_argument bypasses the parser's) get it too."""

    def parse_known_args(self, args=None, namespace=None):
        self._apply_env_defaults()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._apply_env_defaults()
        return super().format_help()

    def _apply_env_defaults(self) -> None:
        for action in self._actions:  # shared with every argument group of this parser
            if not action.option_strings or action.dest == "help" or getattr(action, "_env_applied", False):
                continue
            action._env_applied = True
            env_name = "PDSERVE_" + action.dest.upper()
            if env_name in os.environ:
                raw = os.environ[env_name]
                if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                    action.default = raw.lower() in ("1", "true", "yes", "on")
                else:
                    try:
                        action.default = action.type(raw) if action.type else raw
                    except (TypeError, ValueError):
                        self.error(f"{env_name}={raw!r} is not a valid value for {action.option_strings[0]}")
            if action.help and action.help is not argparse.SUPPRESS:
                action.help += f" [env {env_name}]"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face directory; default: bundled SmolLM2-135M-Instruct")
    g.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size: bytes (2GiB, 512MiB) or a fraction of free memory after weights "
                        "(0.9); default 1GiB on CPU, 0.9 on GPU")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output; default min(model limit, KV capacity)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests running per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--no-chunked-prefill", action="store_true", help="disable chunked prefill")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
                block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=not args.no_prefix_caching,
                enable_chunked_prefill=not args.no_chunked_prefill)


def engine_config_from_args(args: argparse.Namespace):
    """EngineConfig from add_engine_args' flags (the services' counterpart of LLM(...))."""
    from common.engine.config import make_engine_config
    return make_engine_config(**engine_kwargs(args))


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def cmd_generate_offline(args: argparse.Namespace) -> int:
    from common.engine.llm import LLM
    from common.engine.sampling_params import SamplingParams
    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, stop=args.stop)
    if args.raw:
        outputs = llm.generate(args.prompt, params)
    else:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params)
    print(outputs[0].outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = EnvDefaultsParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=EnvDefaultsParser)

    p = sub.add_parser("generate-offline", help="complete a prompt in this process, no services")
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate_offline)

    for name, (module, text) in DELEGATED.items():
        sub.add_parser(name, help=text, add_help=False)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for name, (module, text) in DELEGATED_BENCH.items():
        bench.add_parser(name, help=text, add_help=False)
    return parser


# Commands whose modules own their flags (and their --help): `pdserve NAME ...`.
DELEGATED = {
    "gateway": ("gateway.main", "run the gateway (public Generate API, registry, placement)"),
    "prefill": ("prefill_service.main", "run a prefill instance"),
    "decode": ("decode_service.main", "run a decode instance"),
    "up": ("common.cli.up", "run a local stack: gateway + N prefill + M decode processes"),
    "generate": ("common.cli.generate", "send a prompt to a gateway and print the completion"),
    "health": ("common.cli.health", "exit 0 only if ADDR reports SERVING (grpc.health.v1)"),
}
DELEGATED_BENCH = {
    "offline": ("bench.offline", "LLM.generate vs Hugging Face generate throughput"),
    "transfer": ("bench.transfer", "KV transfer throughput vs plain pyzmq"),
    "serve": ("bench.serve.main",
              "load-test a gateway: TTFT/TPOT/ITL/E2EL, throughput, goodput (vLLM definitions)"),
    "routing": ("bench.routing",
                "placement policies on a real stack: prefill prefix-cache hit rates and TTFT"),
    "disagg": ("bench.disagg",
               "disaggregated vs colocated serving on a real stack: ITL, TPOT, TTFT, goodput"),
}


def _delegated_module(argv: list[str]) -> tuple[str, list[str]] | None:
    if argv and argv[0] in DELEGATED:
        return DELEGATED[argv[0]][0], argv[1:]
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in DELEGATED_BENCH:
        return DELEGATED_BENCH[argv[1]][0], argv[2:]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    delegated = _delegated_module(argv)
    if delegated is not None:
        import importlib
        module, rest = delegated
        return importlib.import_module(module).main(rest) or 0
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
