"""What the prefill and decode workers share: one engine in a role, its metrics, its
load as heartbeats report it, and how the process lifecycle reaches it
(common.service.lifecycle.Worker). Each service adds its servicer and endpoints."""
from __future__ import annotations

import argparse
import logging

from common.engine.async_engine import AsyncEngine
from common.engine.config import KVTransferConfig
from common.engine.engine_args import engine_config_from_args
from common.engine.engine_core import EngineCore
from common.engine.kv_transfer_waiters import KVTransferWaiters
from common.service.common_api import stats_response
from common.service.embedder import Embedder
from common.service.embedding_servicer import EmbeddingServicer
from common.service.engine_requests import eos_token_ids
from common.service.flags import advertised_zmq_endpoint, served_model_name, zmq_bind_endpoint
from common.service.kv_events import KvEventPublisher
from common.service.lora_adapter_servicer import LoRAAdapterServicer
from common.service.lora_modules import LoRAModules
from common.service.metrics import WorkerMetrics
from common.service.registration import InstanceLoad, InstanceSpec, Role, ServedLoRAs
from common.service.tracing import Tracing
from protos.pdserve.v1 import common_pb2

logger = logging.getLogger(__name__)


class EngineWorker:
    role: Role

    def __init__(self, args: argparse.Namespace, instance_id: str, kv_transfer: KVTransferConfig):
        self.args = args
        self.instance_id = instance_id
        # Its prefix cache's events, which the gateway places prompts by (a prefill instance's
        # for the prompts it computes, a decode instance's for those it prefills itself).
        self.kv_events = KvEventPublisher(instance_id, zmq_bind_endpoint(args.host, args.events_port))
        self.kv_events_endpoint = advertised_zmq_endpoint(args, self.kv_events.endpoint)
        try:
            self._start_engine(args, instance_id, kv_transfer)
        except BaseException:
            self.kv_events.close()
            raise

    def _start_engine(self, args: argparse.Namespace, instance_id: str, kv_transfer: KVTransferConfig) -> None:
        self.tracing = Tracing(self.role, instance_id, getattr(args, "otlp_traces_endpoint", None))
        self.lora_modules = LoRAModules.parse(getattr(args, "lora_modules", None))
        config = engine_config_from_args(args)
        config.kv_transfer = kv_transfer
        if kv_transfer.role == "producer" and config.speculative is not None:
            # A prefill instance samples one token per prompt: there is nothing to draft for.
            logger.info("--speculative-config is for decode instances; a prefill instance ignores it")
            config.speculative = None
        # The grammar backend built while the model loads, ready for the first constrained
        # request, unless --no-grammar-warm-up leaves it to that request.
        self.core = EngineCore(config, warm_grammar_backend=getattr(args, "grammar_warm_up", True))
        # Every adapter served is loaded once now, so that one this model cannot serve fails the
        # start, not a request; past max_loras each takes the place of the one loaded longest ago.
        for lora in self.lora_modules.requests:
            self.core.hold_lora(lora)
        # Plain data about the engine's KV connector per rank (tensor parallel ranks each
        # have a pool shard and a receiving endpoint); rank 0's stands for the geometry.
        self.rank_kv_connector_infos: list[dict] = self.core.collective_rpc("kv_connector_info")
        self.kv_connector_info: dict = self.rank_kv_connector_infos[0]
        self.metrics = WorkerMetrics(self.role, instance_id, self.load, lambda: self.engine.stats)
        self.core.step_observer = self.metrics.observe_step
        self.transfer_waiters = KVTransferWaiters()
        # Metrics first: a transfer is counted before anyone waiting on it is answered.
        self.core.kv_transfer_observers += [self.metrics.observe_transfer, self.transfer_waiters]
        self.kv_events.follow(self.core)
        self.engine = AsyncEngine(self.core)  # the engine thread starts here
        self.engine.finished_observers.append(self.metrics.observe_finished)
        # Every instance embeds prompts (EmbeddingService) with the model it serves.
        self.embedder = Embedder(self.engine, self.core, eos_token_ids(self.core), self.lora_modules)

    def embedding_servicer(self, gate) -> EmbeddingServicer:
        """The EmbeddingService each role's server adds beside its own service."""
        return EmbeddingServicer(self.embedder, gate, self.instance_id, self.tracing)

    def lora_adapter_servicer(self) -> LoRAAdapterServicer:
        """The LoRAAdapterService each role's server adds beside its own service."""
        return LoRAAdapterServicer(self.engine, self.lora_modules, self.core.config.lora.enable_lora)

    def endpoints(self) -> dict[str, str]:
        """Its ZeroMQ endpoints, as InstanceSpec fields; a role adds its own (kv_endpoint)."""
        return {"kv_events_endpoint": self.kv_events_endpoint}

    def instance_spec(self, grpc_address: str) -> InstanceSpec:
        return InstanceSpec(instance_id=self.instance_id, role=self.role, grpc_address=grpc_address,
                            block_size=self.core.config.cache.block_size,
                            num_total_blocks=self.core.kv_cache_manager.num_blocks,
                            model_name=served_model_name(self.args), max_model_len=self.core.max_model_len,
                            lora_enabled=self.core.config.lora.enable_lora, **self.endpoints()
                            ).with_loras(self.served_loras())

    def served_loras(self) -> ServedLoRAs:
        return ServedLoRAs(tuple(self.lora_modules.names), self.lora_modules.version, self.lora_modules.runtime_paths)

    def load(self) -> InstanceLoad:
        stats = self.engine.stats
        # Requests waiting for their KV (decode) hold a seat and blocks: they count as running.
        return InstanceLoad(num_running_requests=stats["num_running"] + stats["num_waiting_for_remote_kv"],
                            num_waiting_requests=stats["num_waiting"], num_free_blocks=stats["num_free_blocks"],
                            num_total_blocks=stats["num_total_blocks"],
                            num_queued_prefill_tokens=stats["num_queued_prefill_tokens"],
                            kv_events_sequence=stats.get("kv_events_sequence", 0))

    def stats_pb(self) -> common_pb2.StatsResponse:
        return stats_response(self.instance_id, self.engine.stats, self.load())

    def on_engine_dead(self, callback) -> None:
        """callback(error), from the engine thread, once the engine loop died (a worker
        process of the executor died, a step raised)."""
        self.engine.death_observers.append(callback)
        if self.engine.dead is not None:
            callback(self.engine.dead)

    async def fail_inflight(self) -> None:
        await self.engine.call(lambda core: core.abort_all(), deliver=True)

    async def close(self) -> None:
        self.engine.shutdown()
        self.kv_events.close()
        self.tracing.shutdown()
