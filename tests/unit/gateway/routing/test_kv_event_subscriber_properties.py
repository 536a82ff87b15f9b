"""Property tests of the gateway's side of the KV-event messages (msgpack from each
instance's PUB socket, common.service.kv_events): whatever arrives, the
subscriber's receive loop keeps running; a message it cannot apply makes it resync the
instance instead of crashing or corrupting the index; well-formed batches are applied."""
from __future__ import annotations

import asyncio

import msgpack
from hypothesis import given
from hypothesis import strategies as st

from common.engine.block_pool import BlockRemoved, BlockStored
from gateway.routing.kv_event_subscriber import KvEventSubscriber
from gateway.routing.kv_index import KvIndex
from common.service.kv_events import encode_batch
from tests.support.properties import BOUNDED, msgpack_values

U64 = st.integers(0, 2**64 - 1)
HOSTILE_EVENT = st.fixed_dictionaries({}, optional={
    "seq": st.integers(-2, 5) | msgpack_values,
    "type": st.sampled_from(["stored", "removed", "other"]) | msgpack_values,
    "block_hashes": st.lists(U64, max_size=3) | msgpack_values, "parent_block_hash": U64 | st.none(),
    "token_ids": st.lists(st.integers(0, 100), max_size=3), "block_size": st.integers(-1, 16)})
HOSTILE_PAYLOADS = (st.binary(max_size=64)
                    | st.builds(msgpack.packb, msgpack_values)
                    | st.builds(lambda events: msgpack.packb({"instance_id": "p0", "seq": 1, "events": events}),
                                st.lists(HOSTILE_EVENT | msgpack_values, max_size=4) | msgpack_values))


class ScriptedSocket:
    """Hands out the payloads, then blocks like a quiet socket."""

    def __init__(self, payloads: list[bytes]):
        self.payloads = list(payloads)

    async def recv(self) -> bytes:
        if self.payloads:
            return self.payloads.pop(0)
        await asyncio.Event().wait()


async def receive_all(payloads: list[bytes]) -> tuple[KvIndex, int]:
    index = KvIndex()
    resyncs = []
    subscriber = KvEventSubscriber(index, resync=None)
    subscriber._start_resync = resyncs.append  # record instead of calling a prefill instance
    index.add_instance("p0")
    index.apply_snapshot("p0", 0, [])  # consistent from seq 0 on
    socket = ScriptedSocket(payloads)
    task = asyncio.create_task(subscriber._receive("p0", socket))
    while socket.payloads and not task.done():
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not task.done(), task.exception()  # still receiving: nothing escaped the loop
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    subscriber._context.term()
    return index, len(resyncs)


@BOUNDED
@given(st.lists(HOSTILE_PAYLOADS, min_size=1, max_size=4))
def test_any_payload_keeps_the_receive_loop_running(payloads):
    asyncio.run(receive_all(payloads))


@BOUNDED
@given(st.lists(st.lists(U64, min_size=1, max_size=4), min_size=1, max_size=5))
def test_well_formed_batches_are_applied_without_a_resync(stored):
    events = [BlockStored(seq=i + 1, block_hashes=hashes, parent_block_hash=None, token_ids=[1], block_size=1)
              for i, hashes in enumerate(stored)]
    removed = BlockRemoved(seq=len(events) + 1, block_hashes=stored[0])
    index, resyncs = asyncio.run(receive_all([encode_batch("p0", events), encode_batch("p0", [removed])]))
    assert resyncs == 0
    expected = set().union(*stored) - set(stored[0])
    assert index._instances["p0"].hashes == expected
