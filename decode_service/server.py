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
import time

from grpc import aio

from common.engine.config import KVTransferConfig
from common.service.engine_requests import eos_token_ids, timing_fields, validate_request
from common.service.engine_worker import EngineWorker
from common.service.flags import advertised_zmq_endpoint, zmq_bind_endpoint
from common.service.logging_setup import logged_request
from common.service.request_gate import RequestGate
from common.service.tracing import Tracing
from decode_service.api import DecodeJob, DecodeOutput
from decode_service.decoder import DecodeChunk, Decoder
from kv_transfer import PoolGeometry
from prefill_service.client import PrefillClients
from prefill_service.kv_events import get_cached_blocks_response
from protos.pdserve.v1 import (common_pb2, decode_pb2, decode_pb2_grpc, embedding_pb2_grpc, lora_adapters_pb2_grpc,
                               prefill_pb2)
from protos.serving import DECODE_SERVICE, EMBEDDING_SERVICE, LORA_ADAPTER_SERVICE

logger = logging.getLogger(__name__)

class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, worker: "DecodeWorker", gate: RequestGate):
        self.worker = worker
        self.gate = gate

    async def Decode(self, request: decode_pb2.DecodeRequest, context):
        with logged_request(logger, "decode", request.request_id, context, self.worker.tracing,
                            prompt_tokens=len(request.prompt_token_ids),
                            prefill=request.prefill_instance_id or request.prefill_address or "local",
                            resumed_tokens=len(request.resumed_token_ids)) as end:
            end.update(output_tokens=0, finish_reason=None)
            started = time.monotonic()
            async with self.gate.admit(context):
                job = DecodeJob.from_pb(request)
                job.trace_headers = Tracing.child_headers(end.span)  # its Prefill call's span is this one's child
                validate_request(job.prompt_token_ids, job.params, self.worker.core, job.resumed_token_ids)
                async for chunk in self.worker.decoder.decode(job):
                    if chunk.output.finish_reason == "abort" and self.gate.stopping:
                        raise self.gate.shutdown_error()
                    if not end["output_tokens"] and chunk.output.new_token_ids:
                        # This instance's view of TTFT: admission, the prefill (remote: its queue and
                        # the KV transfer too) and the first step.
                        end["first_token_s"] = round(time.monotonic() - started, 4)
                    end["output_tokens"] += len(chunk.output.new_token_ids)
                    end.update(finish_reason=chunk.output.finish_reason, cached_tokens=chunk.num_cached_tokens,
                               prefilled_by=chunk.prefill_instance_id or "local")
                    end.complete = chunk.output.finish_reason is not None
                    if chunk.output.timings is not None:
                        end.update(timing_fields(chunk.output.timings))
                    yield self.worker.chunk_to_pb(request.request_id, chunk)

    async def Abort(self, request: decode_pb2.AbortRequest, context) -> decode_pb2.AbortResponse:
        return decode_pb2.AbortResponse(num_aborted=await self.worker.decoder.abort(list(request.request_ids)))

    async def Stats(self, request, context) -> common_pb2.StatsResponse:
        return self.worker.stats_pb()

    async def GetCachedBlocks(self, request, context) -> prefill_pb2.GetCachedBlocksResponse:
        return await get_cached_blocks_response(self.worker.engine, self.worker.instance_id)


class DecodeWorker(EngineWorker):
    role = "decode"

    def __init__(self, args: argparse.Namespace, instance_id: str):
        super().__init__(args, instance_id, KVTransferConfig(
            role="consumer", bind_endpoint=zmq_bind_endpoint(args.host, args.kv_port)))
        # One receiving endpoint per tensor-parallel rank; rank 0's is the instance's.
        self.rank_kv_endpoints = [advertised_zmq_endpoint(args, info["endpoint"])
                                  for info in self.rank_kv_connector_infos]
        self.kv_endpoint = self.rank_kv_endpoints[0]
        self.clients = PrefillClients()
        self.decoder = Decoder(self.engine, eos_token_ids(self.core), self.clients, self.transfer_waiters,
                               kv_endpoints=self.rank_kv_endpoints,
                               geometry=PoolGeometry.from_dict(self.kv_connector_info),
                               kv_layout_hash=self.kv_connector_info["kv_layout_hash"],
                               local_prefill_threshold=args.local_prefill_threshold,
                               transfer_timeout_s=args.kv_transfer_timeout,
                               prefill_queue_timeout_s=args.prefill_queue_timeout,
                               local_fallback=not args.no_local_fallback, lora_modules=self.lora_modules)

    def endpoints(self) -> dict[str, str]:
        return {**super().endpoints(), "kv_endpoint": self.kv_endpoint}

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
            request_id=request_id, prompt_logprobs=chunk.prompt_logprobs).to_pb()

    # ---- common.service.lifecycle.Worker ----------------------------------------------------------
    def add_to_server(self, server: aio.Server, gate: RequestGate) -> list[str]:
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(self, gate), server)
        embedding_pb2_grpc.add_EmbeddingServiceServicer_to_server(self.embedding_servicer(gate), server)
        lora_adapters_pb2_grpc.add_LoRAAdapterServiceServicer_to_server(self.lora_adapter_servicer(), server)
        return [DECODE_SERVICE, EMBEDDING_SERVICE, LORA_ADAPTER_SERVICE]

    def ready_fields(self) -> dict[str, str]:
        return {"kv": self.kv_endpoint, "kv_events": self.kv_events_endpoint}

    async def close(self) -> None:
        await super().close()
        await self.clients.close()
