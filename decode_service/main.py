"""`pdserve decode`: run a decode instance (also `python -m decode_service.main`).

Prints `PDSERVE_READY role=decode instance_id=ID grpc=HOST:PORT advertise=ADDR
kv=tcp://HOST:PORT kv_events=tcp://HOST:PORT` on stdout once SERVING; logs go to stderr.
"""
from __future__ import annotations

import sys

from common.service.flags import make_parser
from common.service.lifecycle import run_worker


def build_parser():
    parser = make_parser("decode", "Run a decode instance: receives prompts' KV from prefill instances "
                                   "(or prefills locally) and generates with continuous batching.")
    g = parser.add_argument_group("decode")
    g.add_argument("--kv-port", type=int, default=0,
                   help="ZeroMQ port that receives KV from prefill instances (0 picks a free one)")
    g.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="seconds a KV transfer may take once the prefill instance starts sending it")
    g.add_argument("--prefill-queue-timeout", type=float, default=120.0,
                   help="seconds a request may wait for a slot on its prefill instance before its KV "
                        "transfer starts (its blocks stay reserved meanwhile); the transfer's own "
                        "--kv-transfer-timeout does not run while it waits")
    g.add_argument("--local-prefill-threshold", type=int, default=64,
                   help="prefill locally when fewer prompt tokens than this are missing from the "
                        "local prefix cache; 0 disables")
    g.add_argument("--no-local-fallback", action="store_true",
                   help="fail with UNAVAILABLE instead of prefilling locally when the named prefill "
                        "instance is unreachable")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)

    def build(args, instance_id):
        from decode_service.server import DecodeWorker  # imports torch: after --help
        return DecodeWorker(args, instance_id)
    return run_worker(args, "decode", build)


if __name__ == "__main__":
    sys.exit(main())
