"""A prefill instance that dies in the middle of a KV transfer, as a process of its own:
`python -m tests.integration.dying_prefill`. On its first Prefill call it pushes the
first layer of (random) KV to the decode instance's real receiver over a real ZeroMQ
sender, waits until ZeroMQ has handed those bytes to the kernel, and SIGKILLs itself,
so the decode instance sees the call fail with part of the KV already written."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import torch
from grpc import aio

from kv_transfer import KVTarget, ZmqKVSender
from kv_transfer.base import DTYPES
from prefill_service.api import PrefillJob
from protos.pdserve.v1 import prefill_pb2_grpc


class DyingPrefill(prefill_pb2_grpc.PrefillServiceServicer):
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
        deadline = time.monotonic() + 10
        while sender.pending_bytes() and time.monotonic() < deadline:  # zmq still holds the frames
            await asyncio.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)


async def main() -> None:
    server = aio.server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(DyingPrefill(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"PDSERVE_READY grpc=127.0.0.1:{port} instance_id=dying-prefill", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main())
