"""`pdserve generate`: send one prompt to a gateway and print the completion.

The prompt goes through the chat template unless --raw is given (as with
`pdserve generate-offline`). Exit status: 0 on success, 1 when the gateway
answered with an error (its status and message are printed), 2 on bad flags.
"""
from __future__ import annotations

import argparse
import sys

import grpc

from common.cli.sampling_args import add_sampling_args
from common.service.flags import EnvDefaultsParser


def build_parser() -> argparse.ArgumentParser:
    parser = EnvDefaultsParser(prog="pdserve generate", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--gateway", default="127.0.0.1:50051", help="gateway address HOST:PORT")
    parser.add_argument("--stream", action="store_true", help="print the text as it is generated")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_sampling_args(parser)  # the same sampling flags as generate-offline
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    parser.add_argument("--usage", action="store_true", help="also print token counts and instances")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from gateway.client import Client
    prompt = {"prompt": args.prompt} if args.raw else {"messages": [{"role": "user", "content": args.prompt}]}
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.sampling_seed, stop=args.stop)
    try:
        with Client(args.gateway, timeout=args.timeout) as client:
            if args.stream:
                result = None
                for chunk in client.generate_stream(**prompt, **sampling):
                    print(chunk.text, end="", flush=True)
                    result = chunk
                print()
            else:
                result = client.generate(**prompt, **sampling)
                print(result.text)
    except ValueError as e:  # a sampling value out of range, caught before sending
        print(f"pdserve generate: error: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        print(f"pdserve generate: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if args.usage:
        print(f"[finish={result.finish_reason} prompt={result.usage.prompt_tokens} "
              f"completion={result.usage.completion_tokens} cached={result.usage.cached_prompt_tokens} "
              f"prefill={result.prefill_instance_id or '-'} decode={result.decode_instance_id}]",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
