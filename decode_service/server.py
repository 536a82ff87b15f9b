"""gRPC face of a decode instance (pdserve.v1.DecodeService) and the worker that owns
its engine and KV receiver.

RPC status codes of Decode (a stream; the last message has finish_reason set):
  INVALID_ARGUMENT    bad prompt or sampling parameters, prompt longer than max_model_len
  ALREADY_EXISTS      the request id is in flight here
  RESOURCE_EXHAUSTED  no seat or KV blocks for a remote prefill's KV (nothing was queued)
  UNAVAILABLE         the prefill instance went away (or is unreachable with --no-local-fallback);
                      this instance is draining or shut down before the request finished
  DEADLINE_EXCEEDED   the KV transfer did not complete within --kv-transfer-timeout
  ABORTED             the KV transfer failed (rejected, connection reset)
  other codes         passed through from the prefill instance, message prefixed with its id
An Abort RPC for the request ends its stream normally with FINISH_REASON_ABORT.
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
from decode_service.api import DecodeJob, DecodeOutput
from decode_service.decoder import DecodeChunk, Decoder
from kv_transfer import PoolGeometry
from prefill_service.client import PrefillClients
from protos.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from protos.serving import DECODE_SERVICE

logger = logging.getLogger(__name__)

class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, worker: "DecodeWorker", gate: RequestGate):
        self.worker = worker
        self.gate = gate

    async def Decode(self, request: decode_pb2.DecodeRequest, context):
        with logged_request(logger, "decode", request.request_id, context,
                            prompt_tokens=len(request.prompt_token_ids),
                            prefill=request.prefill_instance_id or request.prefill_address or "local") as end:
            end.update(output_tokens=0, finish_reason=None)
            async with self.gate.admit(context):
                job = DecodeJob.from_pb(request)
                validate_request(job.prompt_token_ids, job.params, self.worker.core)
                async for chunk in self.worker.decoder.decode(job):
                    if chunk.output.finish_reason == "abort" and self.gate.stopping:
                        raise self.gate.shutdown_error()
                    end["output_tokens"] += len(chunk.output.new_token_ids)
                    end.update(finish_reason=chunk.output.finish_reason, cached_tokens=chunk.num_cached_tokens,
                               prefilled_by=chunk.prefill_instance_id or "local")
                    end.complete = chunk.output.finish_reason is not None
                    yield self.worker.chunk_to_pb(request.request_id, chunk)

    async def Abort(self, request: decode_pb2.AbortRequest, context) -> decode_pb2.AbortResponse:
        return decode_pb2.AbortResponse(num_aborted=await self.worker.decoder.abort(list(request.request_ids)))

    async def Stats(self, request, context) -> common_pb2.StatsResponse:
        return self.worker.stats_pb()


class DecodeWorker:
    def __init__(self, args: argparse.Namespace, instance_id: str):
        self.args = args
        self.instance_id = instance_id
        config = engine_config_from_args(args)
        config.kv_transfer = KVTransferConfig(role="consumer",
                                              bind_endpoint=zmq_bind_endpoint(args.host, args.kv_port))
        self.core = EngineCore(config)
        kv_connector_info = self.core.collective_rpc("kv_connector_info")[0]
        self.kv_endpoint = advertised_zmq_endpoint(args, kv_connector_info["endpoint"])
        self.metrics = WorkerMetrics("decode", instance_id, self.load, lambda: self.engine.stats)
        self.core.step_observer = self.metrics.observe_step
        self.transfer_waiters = KVTransferWaiters()
        # Metrics first: a transfer is counted before anyone waiting on it is answered.
        self.core.kv_transfer_observers += [self.metrics.observe_transfer, self.transfer_waiters]
        self.engine = AsyncEngine(self.core)
        self.clients = PrefillClients()
        self.decoder = Decoder(self.engine, eos_token_ids(self.core), self.clients, self.transfer_waiters,
                               kv_endpoint=self.kv_endpoint, geometry=PoolGeometry.from_dict(kv_connector_info),
                               local_prefill_threshold=args.local_prefill_threshold,
                               transfer_timeout_s=args.kv_transfer_timeout,
                               local_fallback=not args.no_local_fallback)

    # ---- protobuf at the edge ----------------------------------------------------------
    def chunk_to_pb(self, request_id: str, chunk: DecodeChunk) -> decode_pb2.DecodeResponse:
        output = chunk.output
        stop_token_id = None
        if isinstance(output.stop_reason, int):
            stop_token_id = output.stop_reason
        elif output.finish_reason == "stop" and output.new_token_ids:  # EOS: stop_reason stays None
            stop_token_id = output.new_token_ids[-1]
        return DecodeOutput(
            token_ids=output.new_token_ids, logprobs=chunk.logprobs or [], finish_reason=output.finish_reason,
            stop_token_id=stop_token_id, num_cached_tokens=chunk.num_cached_tokens,
            prefill_instance_id=chunk.prefill_instance_id, decode_instance_id=self.instance_id,
            request_id=request_id).to_pb()

    def stats_pb(self) -> common_pb2.StatsResponse:
        return stats_response(self.instance_id, self.engine.stats, self.load())

    # ---- common.service.lifecycle.Worker ----------------------------------------------------------
    def add_to_server(self, server: aio.Server, gate: RequestGate) -> list[str]:
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(self, gate), server)
        return [DECODE_SERVICE]

    def instance_spec(self, grpc_address: str) -> InstanceSpec:
        return InstanceSpec(instance_id=self.instance_id, role="decode", grpc_address=grpc_address,
                            kv_endpoint=self.kv_endpoint, block_size=self.core.config.cache.block_size,
                            num_total_blocks=self.core.kv_cache_manager.num_blocks,
                            model_name=served_model_name(self.args), max_model_len=self.core.max_model_len)

    def load(self) -> InstanceLoad:
        stats = self.engine.stats
        # Requests waiting for their KV hold a seat and blocks: they count as running.
        return InstanceLoad(num_running_requests=stats["num_running"] + stats["num_waiting_for_remote_kv"],
                            num_waiting_requests=stats["num_waiting"], num_free_blocks=stats["num_free_blocks"],
                            num_total_blocks=stats["num_total_blocks"],
                            num_queued_prefill_tokens=stats["num_queued_prefill_tokens"])

    def ready_fields(self) -> dict[str, str]:
        return {"kv": self.kv_endpoint}

    async def fail_inflight(self) -> None:
        await self.engine.call(lambda core: core.abort_all(), deliver=True)

    async def close(self) -> None:
        self.engine.shutdown()
        await self.clients.close()
