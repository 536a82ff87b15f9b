"""gRPC face of a prefill instance (pdserve.v1.PrefillService) and the worker that
owns its engine, KV sender and KV event publisher.

RPC status codes:
  Prefill  INVALID_ARGUMENT  bad prompt/sampling/kv_target (nothing was queued)
           FAILED_PRECONDITION  the decode pool's geometry or KV layout hash differs from ours
           ALREADY_EXISTS    the request id is in flight here
           DEADLINE_EXCEEDED the KV target expired (before or during the transfer)
           ABORTED           the KV transfer failed (receiver rejected it, connection reset)
           UNAVAILABLE       draining / shutting down
           (a cancelled call aborts the prefill and frees its blocks)
"""
from __future__ import annotations

import argparse
import logging

from grpc import aio

from common.engine.config import KVTransferConfig
from common.service.engine_requests import eos_token_ids, timing_fields, validate_request
from common.service.engine_worker import EngineWorker
from common.service.logging_setup import logged_request
from common.service.request_gate import RequestGate
from kv_transfer import PoolGeometry
from prefill_service.api import PrefillJob
from prefill_service.kv_events import get_cached_blocks_response
from prefill_service.kv_export import export_target
from prefill_service.prefiller import Prefiller
from protos.pdserve.v1 import common_pb2, embedding_pb2_grpc, lora_adapters_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from protos.serving import EMBEDDING_SERVICE, LORA_ADAPTER_SERVICE, PREFILL_SERVICE

logger = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, worker: "PrefillWorker", gate: RequestGate):
        self.worker = worker
        self.gate = gate

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        with logged_request(logger, "prefill", request.request_id, context, self.worker.tracing,
                            prompt_tokens=len(request.prompt_token_ids),
                            decode_kv=request.kv_target.kv_endpoint or "none") as end:
            async with self.gate.admit(context):
                job = PrefillJob.from_pb(request)
                validate_request(job.prompt_token_ids, job.params.clone(n=1), self.worker.core)
                export = None if job.kv_target is None else export_target(
                    job.kv_target, len(job.prompt_token_ids), self.worker.geometry, self.worker.default_kv_timeout_s,
                    self.worker.kv_connector_info)
                result = await self.worker.prefiller.prefill(job, export)
                result.instance_id = self.worker.instance_id
                end.update(cached_tokens=result.num_cached_tokens, kv_blocks_sent=result.num_transferred_blocks)
                if result.timings is not None:
                    end.update(timing_fields(result.timings))
                return result.to_pb(request.request_id)

    async def Stats(self, request, context) -> common_pb2.StatsResponse:
        return self.worker.stats_pb()

    async def GetCachedBlocks(self, request, context) -> prefill_pb2.GetCachedBlocksResponse:
        return await get_cached_blocks_response(self.worker.engine, self.worker.instance_id)


class PrefillWorker(EngineWorker):
    role = "prefill"

    def __init__(self, args: argparse.Namespace, instance_id: str):
        self.default_kv_timeout_s = args.kv_transfer_timeout
        super().__init__(args, instance_id,
                         KVTransferConfig(role="producer", layerwise_send=not args.no_layerwise_kv_send))
        self.geometry = PoolGeometry.from_dict(self.kv_connector_info)
        self.prefiller = Prefiller(self.engine, eos_token_ids(self.core), self.transfer_waiters, self.lora_modules)

    # ---- common.service.lifecycle.Worker ----------------------------------------------------------
    def add_to_server(self, server: aio.Server, gate: RequestGate) -> list[str]:
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(self, gate), server)
        embedding_pb2_grpc.add_EmbeddingServiceServicer_to_server(self.embedding_servicer(gate), server)
        lora_adapters_pb2_grpc.add_LoRAAdapterServiceServicer_to_server(self.lora_adapter_servicer(), server)
        return [PREFILL_SERVICE, EMBEDDING_SERVICE, LORA_ADAPTER_SERVICE]

    def ready_fields(self) -> dict[str, str]:
        return {"kv_events": self.kv_events_endpoint}
