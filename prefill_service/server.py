"""gRPC face of a prefill instance (pdserve.v1.PrefillService) and the worker that
owns its engine, KV sender and KV event publisher.

RPC status codes:
  Prefill  INVALID_ARGUMENT  bad prompt/sampling/kv_target (nothing was queued)
           FAILED_PRECONDITION  the decode pool's geometry differs from ours
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

from common.engine.async_engine import AsyncEngine
from common.engine.config import KVTransferConfig
from common.engine.engine_args import engine_config_from_args
from common.engine.engine_core import EngineCore
from common.engine.kv_transfer_waiters import KVTransferWaiters
from common.service.common_api import stats_response
from common.service.engine_requests import eos_token_ids, validate_request
from common.service.flags import advertised_zmq_endpoint, served_model_name, zmq_bind_endpoint
from common.service.logging_setup import logged_request
from common.service.metrics import WorkerMetrics
from common.service.registration import InstanceLoad, InstanceSpec
from common.service.request_gate import RequestGate
from kv_transfer import PoolGeometry
from prefill_service.api import PrefillJob
from prefill_service.kv_events import KvEventPublisher, cached_blocks_snapshot
from prefill_service.kv_export import export_target
from prefill_service.prefiller import Prefiller
from protos.pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from protos.serving import PREFILL_SERVICE

logger = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, worker: "PrefillWorker", gate: RequestGate):
        self.worker = worker
        self.gate = gate

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        with logged_request(logger, "prefill", request.request_id, context,
                            prompt_tokens=len(request.prompt_token_ids),
                            decode_kv=request.kv_target.kv_endpoint or "none") as end:
            async with self.gate.admit(context):
                job = PrefillJob.from_pb(request)
                validate_request(job.prompt_token_ids, job.params.clone(n=1), self.worker.core)
                export = None if job.kv_target is None else export_target(
                    job.kv_target, len(job.prompt_token_ids), self.worker.geometry, self.worker.default_kv_timeout_s)
                result = await self.worker.prefiller.prefill(job, export)
                result.instance_id = self.worker.instance_id
                end.update(cached_tokens=result.num_cached_tokens, kv_blocks_sent=result.num_transferred_blocks)
                return result.to_pb(request.request_id)

    async def Stats(self, request, context) -> common_pb2.StatsResponse:
        return self.worker.stats_pb()

    async def GetCachedBlocks(self, request, context) -> prefill_pb2.GetCachedBlocksResponse:
        instance_id = self.worker.instance_id
        snapshot = await self.worker.engine.call(lambda core: cached_blocks_snapshot(instance_id, core.kv_cache_manager))
        return snapshot.to_pb()


class PrefillWorker:
    def __init__(self, args: argparse.Namespace, instance_id: str):
        self.args = args
        self.instance_id = instance_id
        self.default_kv_timeout_s = args.kv_transfer_timeout
        self.events = events = KvEventPublisher(instance_id, zmq_bind_endpoint(args.host, args.events_port))
        config = engine_config_from_args(args)
        config.kv_transfer = KVTransferConfig(role="producer", layerwise_send=not args.no_layerwise_kv_send)
        try:
            self.core = EngineCore(config)
        except BaseException:
            events.close()
            raise
        self.geometry = PoolGeometry.from_dict(self.core.collective_rpc("kv_connector_info")[0])
        self.events_endpoint = advertised_zmq_endpoint(args, events.endpoint)
        # KV cache events go out after every step; heartbeats carry the last sequence sent.
        self.core.after_step.append(lambda core: events.publish(core.kv_cache_manager.take_events()))
        self.core.stats_sources.append(lambda: {"kv_events_sequence": events.last_published_seq})
        self.metrics = WorkerMetrics("prefill", instance_id, self.load, lambda: self.engine.stats)
        self.core.step_observer = self.metrics.observe_step
        self.transfer_waiters = KVTransferWaiters()
        # Metrics first: a transfer is counted before anyone waiting on it is answered.
        self.core.kv_transfer_observers += [self.metrics.observe_transfer, self.transfer_waiters]
        self.engine = AsyncEngine(self.core)
        self.prefiller = Prefiller(self.engine, eos_token_ids(self.core), self.transfer_waiters)

    # ---- protobuf at the edge ----------------------------------------------------------
    def stats_pb(self) -> common_pb2.StatsResponse:
        return stats_response(self.instance_id, self.engine.stats, self.load())

    # ---- common.service.lifecycle.Worker ----------------------------------------------------------
    def add_to_server(self, server: aio.Server, gate: RequestGate) -> list[str]:
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(self, gate), server)
        return [PREFILL_SERVICE]

    def instance_spec(self, grpc_address: str) -> InstanceSpec:
        return InstanceSpec(instance_id=self.instance_id, role="prefill", grpc_address=grpc_address,
                            kv_events_endpoint=self.events_endpoint,
                            block_size=self.core.config.cache.block_size,
                            num_total_blocks=self.core.kv_cache_manager.num_blocks,
                            model_name=served_model_name(self.args), max_model_len=self.core.max_model_len)

    def load(self) -> InstanceLoad:
        stats = self.engine.stats
        return InstanceLoad(num_running_requests=stats["num_running"], num_waiting_requests=stats["num_waiting"],
                            num_free_blocks=stats["num_free_blocks"], num_total_blocks=stats["num_total_blocks"],
                            num_queued_prefill_tokens=stats["num_queued_prefill_tokens"],
                            kv_events_sequence=stats["kv_events_sequence"])

    def ready_fields(self) -> dict[str, str]:
        return {"kv_events": self.events_endpoint}

    async def fail_inflight(self) -> None:
        await self.engine.call(lambda core: core.abort_all(), deliver=True)

    async def close(self) -> None:
        self.engine.shutdown()
        self.events.close()
