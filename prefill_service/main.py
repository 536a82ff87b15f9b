"""`pdserve prefill`: run a prefill instance (also `python -m prefill_service.main`).

Prints `PDSERVE_READY role=prefill instance_id=ID grpc=HOST:PORT advertise=ADDR
kv_events=tcp://HOST:PORT` on stdout once SERVING; logs go to stderr.
"""
from __future__ import annotations

import sys

from common.service.flags import make_parser
from common.service.lifecycle import run_worker


def build_parser():
    parser = make_parser("prefill", "Run a prefill instance: chunked prefill with prefix caching; "
                                    "pushes each prompt's KV to the decode instance that asked for it.")
    g = parser.add_argument_group("prefill")
    g.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="seconds a KV transfer may take when the target names no timeout")
    g.add_argument("--no-layerwise-kv-send", action="store_true",
                   help="send a prompt's KV after its forward pass instead of layer by layer during it")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)

    def build(args, instance_id):
        from prefill_service.server import PrefillWorker  # imports torch: after --help
        return PrefillWorker(args, instance_id)
    return run_worker(args, "prefill", build)


if __name__ == "__main__":
    sys.exit(main())
