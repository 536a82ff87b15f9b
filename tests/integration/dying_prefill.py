"""A prefill instance that dies in the middle of a KV transfer, as a process of its own:
`python -m tests.integration.dying_prefill DECODE_LOG`. On its first Prefill call it
pushes the first layer of (random) KV to the decode instance's real receiver over a real
ZeroMQ sender, waits until the decode instance (run with --log-level DEBUG, logging to
DECODE_LOG) has written it into its pool, and SIGKILLs itself, so the decode instance
sees the call fail with part of the KV already written. Waiting only for ZeroMQ to hand
the bytes to the kernel was not enough: the decode instance could see the call fail
before its receiver thread read them."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import torch
from grpc import aio

from kv_transfer import KVTarget, ZmqKVSender
from kv_transfer.base import DTYPES
from prefill_service.api import PrefillJob
from protos.pdserve.v1 import prefill_pb2_grpc


class DyingPrefill(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, decode_log: Path) -> None:
        self.decode_log = decode_log

    async def Prefill(self, request, context):
        spec = PrefillJob.from_pb(request).kv_target
        num_blocks = len(spec.dst_block_ids)
        shape = (num_blocks, *spec.block_shape)  # [num_blocks, block_size, num_kv_heads, head_dim]
        pool = [(torch.randn(shape).to(DTYPES[spec.dtype]), torch.randn(shape).to(DTYPES[spec.dtype]))
                for _ in range(spec.num_layers)]
        sender = ZmqKVSender(pool)
        target = KVTarget(spec.transfer_id, spec.kv_endpoint, tuple(spec.dst_block_ids), spec.num_layers,
                          spec.dtype, tuple(spec.block_shape), time.time() + 30)
        transfer = sender.start(list(range(num_blocks)), target)
        sender.send_layer(transfer, 0)
        landed = f"transfer {spec.transfer_id}: first KV landed"
        deadline = time.monotonic() + 30
        while landed not in self.decode_log.read_text(errors="replace"):
            if time.monotonic() > deadline:
                print(f"the decode instance never logged {landed!r}", file=sys.stderr, flush=True)
                break  # die anyway: the test then fails on the decode log, saying why
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)


async def main(decode_log: Path) -> None:
    server = aio.server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(DyingPrefill(decode_log), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"PDSERVE_READY grpc=127.0.0.1:{port} instance_id=dying-prefill", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
