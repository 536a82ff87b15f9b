"""`pdserve generate-offline PROMPT`: complete a prompt in this process, no services."""
from __future__ import annotations

import logging
import sys

from common.cli.sampling_args import add_sampling_args
from common.engine.engine_args import add_engine_args, engine_kwargs
from common.service.flags import EnvDefaultsParser


def main(argv: list[str] | None = None) -> int:
    parser = EnvDefaultsParser(prog="pdserve generate-offline", description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR")
    add_engine_args(parser)
    add_sampling_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from common.engine.llm import LLM  # torch: only once the flags are good
    from common.engine.sampling_params import SamplingParams
    try:
        llm = LLM(**engine_kwargs(args))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.sampling_seed, stop=args.stop)
        if args.raw:
            outputs = llm.generate(args.prompt, params)
        else:
            outputs = llm.chat([{"role": "user", "content": args.prompt}], params)
    except ValueError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    print(outputs[0].outputs[0].text)
    return 0
