"""Calls to prefill instances: one channel per address, the Prefill request with
its kv_target, and how a failed call reads as a status of our own Decode stream."""
from __future__ import annotations

import grpc
from grpc import aio

from common.engine.request import Request
from common.service.common_api import sampling_params_to_pb
from kv_transfer import PoolGeometry
from protos.pdserve.v1 import prefill_pb2, prefill_pb2_grpc

# Beyond the KV transfer's own timeout, how long the Prefill RPC may take to report.
RPC_SLACK_S = 5.0


class PrefillClients:
    def __init__(self):
        self._stubs: dict[str, tuple[aio.Channel, prefill_pb2_grpc.PrefillServiceStub]] = {}

    def stub(self, address: str) -> prefill_pb2_grpc.PrefillServiceStub:
        entry = self._stubs.get(address)
        if entry is None:
            channel = aio.insecure_channel(address)
            entry = self._stubs[address] = (channel, prefill_pb2_grpc.PrefillServiceStub(channel))
        return entry[1]

    def prefill(self, address: str, request: prefill_pb2.PrefillRequest, transfer_timeout_s: float):
        """Start the call; the returned call is awaitable and cancellable."""
        return self.stub(address).Prefill(request, timeout=transfer_timeout_s + RPC_SLACK_S)

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()


def prefill_request(request: Request, *, kv_endpoint: str, transfer_id: str, dst_block_ids: list[int],
                    first_block_index: int, geometry: PoolGeometry,
                    transfer_timeout_s: float) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=request.req_id, prompt_token_ids=request.prompt_token_ids,
        sampling=sampling_params_to_pb(request.sampling_params), priority=request.priority,
        kv_target=prefill_pb2.KvTarget(
            kv_endpoint=kv_endpoint, transfer_id=transfer_id, dst_block_ids=dst_block_ids,
            first_block_index=first_block_index, num_layers=geometry.num_layers, dtype=geometry.dtype,
            block_shape=list(geometry.block_shape), timeout_ms=max(1, round(transfer_timeout_s * 1000))))


def prefill_failure_status(error: aio.AioRpcError, prefill: str) -> tuple[grpc.StatusCode, str]:
    """Our status for a Prefill call that failed: its own code, except that a prefill
    instance that is gone or gave up reads as UNAVAILABLE."""
    code = error.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return grpc.StatusCode.UNAVAILABLE, f"prefill instance {prefill} is unavailable: {error.details()}"
    return code, f"prefill instance {prefill}: {error.details()}"
