"""EmbeddingDispatcher.place: a prefill instance while one has room under the queue limit,
else a decode instance by load, and a full prefill queue only where no decode instance can
take the embedding."""
from __future__ import annotations

import grpc
import pytest

from common.engine.pooling_params import PoolingParams
from common.service.errors import ServiceError
from common.service.metrics import GatewayMetrics
from common.service.registration import InstanceLoad, InstanceSpec
from gateway.routing.embedding_dispatcher import EmbeddingDispatcher
from gateway.routing.kv_index import KvIndex
from gateway.routing.load_ledger import LoadLedger
from gateway.routing.policies import LeastLoaded
from gateway.routing.registry import InstanceRegistry
from gateway.types import PreparedEmbedding
from tests.unit.gateway.routing.instances import BLOCK, queued

EMBEDDING = PreparedEmbedding("emb-1", list(range(100, 140)), PoolingParams())


def make_dispatcher(queued_tokens: dict[str, int], decode_ids: list[str], limit: int) -> EmbeddingDispatcher:
    """Prefill instances with their queued prompt tokens and idle decode instances, in one registry."""
    registry = InstanceRegistry(clock=lambda: 0.0)
    for role, loads in (("prefill", {i: queued(t) for i, t in queued_tokens.items()}),
                        ("decode", {i: InstanceLoad() for i in decode_ids})):
        for instance_id, load in loads.items():
            registry.register(InstanceSpec(instance_id, role, f"{instance_id}:1", block_size=BLOCK,
                                           num_total_blocks=load.num_total_blocks))
            registry.heartbeat(instance_id, load)
    return EmbeddingDispatcher(registry, LoadLedger(KvIndex()), LeastLoaded(), GatewayMetrics("least_loaded"), limit)


def placed_on(dispatcher: EmbeddingDispatcher, tried: frozenset[str] = frozenset()) -> str:
    instance, charge = dispatcher.place(EMBEDDING, set(tried))
    charge.release()
    return instance.instance_id


def decisions(dispatcher: EmbeddingDispatcher, pool: str, result: str) -> float:
    return dispatcher.metrics.registry.get_sample_value("pdserve_placement_decisions_total",
                                                        {"policy": "least_loaded", "pool": pool, "result": result}) or 0.0


def test_a_prefill_instance_with_room_computes_it():
    dispatcher = make_dispatcher({"p0": 900, "p1": 100}, ["d0"], limit=256)
    assert dispatcher.uses_prefill_pool() and placed_on(dispatcher) == "p1"
    assert decisions(dispatcher, "prefill", "placed") == 1


def test_every_prefill_queue_full_sends_it_to_a_decode_instance():
    dispatcher = make_dispatcher({"p0": 900, "p1": 256}, ["d0"], limit=256)
    assert not dispatcher.uses_prefill_pool() and placed_on(dispatcher) == "d0"
    assert decisions(dispatcher, "prefill", "queue_full") == 1 and decisions(dispatcher, "decode", "placed") == 1


def test_without_a_limit_a_full_queue_still_takes_it():
    dispatcher = make_dispatcher({"p0": 100_000}, ["d0"], limit=0)
    assert dispatcher.uses_prefill_pool() and placed_on(dispatcher) == "p0"


def test_with_no_decode_instance_to_take_it_a_full_queue_does():
    dispatcher = make_dispatcher({"p0": 900}, [], limit=256)
    assert dispatcher.uses_prefill_pool() and placed_on(dispatcher) == "p0"
    # The decode instance already tried (its call failed): back to the full queue.
    assert placed_on(make_dispatcher({"p0": 900}, ["d0"], limit=256), tried=frozenset({"d0"})) == "p0"


def test_nothing_left_to_try_is_unavailable():
    dispatcher = make_dispatcher({"p0": 900}, ["d0"], limit=256)
    with pytest.raises(ServiceError) as error:
        dispatcher.place(EMBEDDING, {"p0", "d0"})
    assert error.value.code == grpc.StatusCode.UNAVAILABLE
