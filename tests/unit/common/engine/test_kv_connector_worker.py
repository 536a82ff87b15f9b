"""The worker half of the connector over real transports on loopback (ZeroMQ, and Gloo
for torch.distributed): one producer and one consumer, driven only through their
interface and plain metadata, as a model runner drives them."""
from __future__ import annotations

import time

import pytest
import torch

from common.engine.config import KVTransferConfig
from common.engine.kv_connector.factory import make_worker_connector
from common.engine.kv_connector.metadata import KVConnectorMetadata, KVRecvSpec, KVSendSpec
from kv_transfer import KVTarget

NUM_LAYERS, NUM_BLOCKS, BLOCK_SHAPE = 3, 16, (4, 2, 8)
DEADLINE_S = 20.0
pytestmark = pytest.mark.timeout(90)


def pool(seed: int | None):
    """Per layer (K, V), each [NUM_BLOCKS, block_size, num_kv_heads, head_dim]."""
    if seed is None:
        return [(torch.zeros(NUM_BLOCKS, *BLOCK_SHAPE), torch.zeros(NUM_BLOCKS, *BLOCK_SHAPE))
                for _ in range(NUM_LAYERS)]
    generator = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(NUM_BLOCKS, *BLOCK_SHAPE, generator=generator) for _ in range(2))
            for _ in range(NUM_LAYERS)]


BIND_ENDPOINTS = {"zmq": "tcp://127.0.0.1:*", "gloo": "gloo://127.0.0.1:0"}


@pytest.fixture(params=["zmq", "gloo"])
def backend(request) -> str:
    return request.param


@pytest.fixture
def workers(backend):
    made = []

    def make(role: str, kv_caches, layerwise_send: bool = True):
        worker = make_worker_connector(KVTransferConfig(role=role, backend=backend,
                                                        bind_endpoint=BIND_ENDPOINTS[backend],
                                                        layerwise_send=layerwise_send))
        worker.register_kv_caches(kv_caches)
        made.append(worker)
        return worker
    yield make
    for worker in made:
        worker.close()


def target_of(consumer, transfer_id: str, dst_block_ids: list[int], timeout_s: float = 10.0) -> dict:
    info = consumer.info()
    return KVTarget(transfer_id=transfer_id, endpoint=info["endpoint"], dst_block_ids=tuple(dst_block_ids),
                    num_layers=info["num_layers"], dtype=info["dtype"], block_shape=tuple(info["block_shape"]),
                    deadline=time.time() + timeout_s).to_dict()


def wait_finished(worker, num_outcomes: int = 1) -> list:
    """get_finished until num_outcomes transfers are reported, as the runner calls it each step."""
    outcomes = []
    deadline = time.monotonic() + DEADLINE_S
    while len(outcomes) < num_outcomes:
        assert time.monotonic() < deadline, f"only {len(outcomes)} of {num_outcomes} transfers ended"
        outcomes += worker.get_finished()
        time.sleep(0.002)
    return outcomes


def run_step(producer, metadata: KVConnectorMetadata) -> None:
    """What the runner does around one forward pass."""
    producer.start_load_kv(metadata)
    if producer.needs_layer_hook:
        for layer_idx in range(NUM_LAYERS):
            producer.wait_for_layer_load(layer_idx)
            producer.save_kv_layer(layer_idx)
    producer.wait_for_save()


@pytest.mark.parametrize("layerwise_send", [True, False])
def test_a_prompts_kv_moves_between_the_workers(workers, layerwise_send):
    src, dst = pool(0), pool(None)
    producer, consumer = workers("producer", src, layerwise_send), workers("consumer", dst)
    dst_block_ids, src_block_ids = [9, 3, 4], [0, 1, 7]
    consumer.start_load_kv(KVConnectorMetadata(recvs=[KVRecvSpec("r", "t-1", dst_block_ids, 10.0)]))
    run_step(producer, KVConnectorMetadata(sends=[KVSendSpec("r", src_block_ids, target_of(consumer, "t-1",
                                                                                             dst_block_ids))]))
    assert producer.needs_layer_hook is False  # the step's sends are handed over
    [sent], [received] = wait_finished(producer), wait_finished(consumer)
    assert (sent.req_id, sent.direction, sent.state) == ("r", "send", "done")
    assert (received.req_id, received.direction, received.state) == ("r", "recv", "done")
    assert received.received_any and received.num_bytes == sent.num_bytes == 2 * NUM_LAYERS * 3 * 4 * 2 * 8 * 4
    for layer_idx in range(NUM_LAYERS):
        for kv in (0, 1):
            assert torch.equal(dst[layer_idx][kv][dst_block_ids], src[layer_idx][kv][src_block_ids])
    assert producer.get_finished() == [] and consumer.get_finished() == []  # reported once


def test_fp8_pools_move_their_codes_byte_for_byte(workers):
    """kv_cache_dtype fp8: a pool of E4M3 codes travels as its bytes, a quarter of fp32's."""
    src = [tuple(t.clamp(-448, 448).to(torch.float8_e4m3fn) for t in kv) for kv in pool(1)]
    dst = [tuple(torch.zeros(NUM_BLOCKS, *BLOCK_SHAPE, dtype=torch.float8_e4m3fn) for _ in range(2))
           for _ in range(NUM_LAYERS)]
    producer, consumer = workers("producer", src), workers("consumer", dst)
    assert consumer.info()["dtype"] == "float8_e4m3fn"
    dst_block_ids, src_block_ids = [2, 11], [5, 6]
    consumer.start_load_kv(KVConnectorMetadata(recvs=[KVRecvSpec("r", "t-8", dst_block_ids, 10.0)]))
    run_step(producer, KVConnectorMetadata(sends=[KVSendSpec("r", src_block_ids, target_of(consumer, "t-8",
                                                                                             dst_block_ids))]))
    [sent], [received] = wait_finished(producer), wait_finished(consumer)
    assert (sent.state, received.state) == ("done", "done")
    assert received.num_bytes == sent.num_bytes == 2 * NUM_LAYERS * 2 * 4 * 2 * 8
    for layer_idx in range(NUM_LAYERS):
        for kv in (0, 1):
            assert torch.equal(dst[layer_idx][kv][dst_block_ids].view(torch.uint8),
                               src[layer_idx][kv][src_block_ids].view(torch.uint8))


def test_a_receive_nobody_sends_expires(workers):
    consumer = workers("consumer", pool(None))
    consumer.start_load_kv(KVConnectorMetadata(recvs=[KVRecvSpec("r", "t-2", [1, 2], 0.2)]))
    [outcome] = wait_finished(consumer)
    assert (outcome.req_id, outcome.state, outcome.received_any) == ("r", "expired", False)


def test_an_abort_in_the_metadata_cancels_an_open_receive(workers):
    consumer = workers("consumer", pool(None))
    consumer.start_load_kv(KVConnectorMetadata(recvs=[KVRecvSpec("r", "t-3", [1, 2], 10.0)]))
    consumer.start_load_kv(KVConnectorMetadata(abort_req_ids=["r"], abort_reason={"r": "client went away"}))
    [outcome] = wait_finished(consumer)
    assert outcome.state == "failed" and "client went away" in outcome.reason


def test_a_failed_forward_pass_aborts_the_steps_sends(workers, backend):
    producer, consumer = workers("producer", pool(0)), workers("consumer", pool(None))
    consumer.start_load_kv(KVConnectorMetadata(recvs=[KVRecvSpec("r", "t-4", [5], 2.0)]))
    producer.start_load_kv(KVConnectorMetadata(sends=[KVSendSpec("r", [2], target_of(consumer, "t-4", [5]))]))
    producer.save_kv_layer(0)
    producer.abort_saves("the forward pass failed")
    [sent], [received] = wait_finished(producer), wait_finished(consumer)
    assert sent.state == "failed" and not received.ok
    if backend == "zmq":  # ZeroMQ tells the receiver at once; Gloo's receiver sees its deadline pass
        assert received.state == "failed"


def test_a_target_the_sender_rejects_is_reported_failed(workers):
    producer = workers("producer", pool(0))
    producer.start_load_kv(KVConnectorMetadata(sends=[KVSendSpec("r", [2], {"transfer_id": "t-5"})]))
    producer.wait_for_save()
    [sent] = wait_finished(producer)
    assert (sent.req_id, sent.state) == ("r", "failed")


def shard_pool(num_heads: int, seed: int | None):
    """A tensor-parallel rank's pool: per layer (K, V), each [NUM_BLOCKS, block_size, num_heads, head_dim]."""
    shape = (NUM_BLOCKS, BLOCK_SHAPE[0], num_heads, BLOCK_SHAPE[2])
    if seed is None:
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(NUM_LAYERS)]
    generator = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(shape, generator=generator) for _ in range(2)) for _ in range(NUM_LAYERS)]


def make_rank(role: str, kv_caches, backend: str, tp_rank: int, tp_size: int):
    worker = make_worker_connector(KVTransferConfig(role=role, backend=backend, bind_endpoint=BIND_ENDPOINTS[backend]),
                                   tp_rank, tp_size, num_kv_heads=2)
    worker.register_kv_caches(kv_caches)
    return worker


@pytest.mark.parametrize("src_tp, dst_tp", [(2, 1), (1, 2)])
def test_tensor_parallel_ranks_of_different_sizes_exchange_their_head_shards(backend, src_tp, dst_tp):
    """2 KV heads: a TP 2 rank holds one, a TP 1 rank both. Every decode rank gets exactly its heads."""
    src_pools = [shard_pool(2 // src_tp, seed=rank) for rank in range(src_tp)]
    dst_pools = [shard_pool(2 // dst_tp, seed=None) for _ in range(dst_tp)]
    producers = [make_rank("producer", p, backend, rank, src_tp) for rank, p in enumerate(src_pools)]
    consumers = [make_rank("consumer", p, backend, rank, dst_tp) for rank, p in enumerate(dst_pools)]
    try:
        src_block_ids, dst_block_ids = [0, 5, 6], [9, 3, 4]
        for consumer in consumers:
            consumer.start_load_kv(KVConnectorMetadata(recvs=[KVRecvSpec("r", "t-tp", dst_block_ids, 10.0)]))
        target = target_of(consumers[0], "t-tp", dst_block_ids) | {
            "rank_endpoints": [c.info()["endpoint"] for c in consumers]}
        for producer in producers:
            run_step(producer, KVConnectorMetadata(sends=[KVSendSpec("r", src_block_ids, target)]))
        sent = [wait_finished(p) for p in producers]
        received = [wait_finished(c) for c in consumers]
        assert [o.state for [o] in sent + received] == ["done"] * (src_tp + dst_tp)
        total_bytes = 2 * NUM_LAYERS * 3 * BLOCK_SHAPE[0] * 2 * BLOCK_SHAPE[2] * 4
        assert sum(o.num_bytes for [o] in sent) == sum(o.num_bytes for [o] in received) == total_bytes
        for layer_idx in range(NUM_LAYERS):
            for kv in (0, 1):
                # Every head of the model, in order, as the prefill side holds it: [3, block_size, 2, head_dim]
                whole = torch.cat([p[layer_idx][kv][src_block_ids] for p in src_pools], dim=2)
                got = torch.cat([p[layer_idx][kv][dst_block_ids] for p in dst_pools], dim=2)
                assert torch.equal(got, whole)
    finally:
        for worker in producers + consumers:
            worker.close()


def test_each_rank_listens_on_its_own_port_or_path():
    from common.engine.kv_connector.transfer_worker import bind_endpoint_of_rank
    assert bind_endpoint_of_rank("tcp://10.0.0.5:5601", 0) == "tcp://10.0.0.5:5601"
    assert bind_endpoint_of_rank("tcp://10.0.0.5:5601", 2) == "tcp://10.0.0.5:5603"
    assert bind_endpoint_of_rank("tcp://[::1]:*", 1) == "tcp://[::1]:*"
    assert bind_endpoint_of_rank("gloo://127.0.0.1:0", 1) == "gloo://127.0.0.1:0"
    assert bind_endpoint_of_rank("ipc:///tmp/kv", 1) == "ipc:///tmp/kv-rank1"
