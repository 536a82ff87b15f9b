"""LoadLedger: what a placement charges its instances, and releasing exactly that."""
from __future__ import annotations

from common.service.registration import InstanceLoad, InstanceSpec
from gateway.routing.kv_index import KvIndex
from gateway.routing.load_ledger import LoadLedger, decode_blocks_needed
from tests.unit.gateway.routing.instances import BLOCK, make_registry, queued

REPORTED = InstanceLoad(num_running_requests=1, num_free_blocks=60, num_total_blocks=100,
                        num_queued_prefill_tokens=700)


def loads(*instances):
    return [(i.num_requests, i.queued_prefill_tokens, i.free_blocks) for i in instances]


def prefill_and_decode():
    prefills = make_registry("prefill", {"p": REPORTED})
    decodes = make_registry("decode", {"d": REPORTED})
    return prefills.get("p"), decodes.get("d")


def test_charge_then_release_restores_the_load_exactly():
    prefill, decode = prefill_and_decode()
    ledger = LoadLedger(KvIndex())
    before = loads(prefill, decode)
    charge = ledger.charge(40, prefill=prefill, prompt_block_hashes=[7, 8], decode=decode)
    assert loads(prefill, decode) == [(2, 740, 60), (2, 700, 60 - decode_blocks_needed(40, BLOCK))]
    charge.release()
    assert loads(prefill, decode) == before


def test_release_is_idempotent():
    prefill, decode = prefill_and_decode()
    ledger = LoadLedger(KvIndex())
    other = ledger.charge(100, prefill=prefill, decode=decode)  # stays charged
    charged = loads(prefill, decode)
    charge = ledger.charge(40, prefill=prefill, decode=decode)
    charge.release_prefill()  # the first token
    charge.release_prefill()
    charge.release()  # the end of the stream
    charge.release()
    assert loads(prefill, decode) == charged
    other.release()


def test_prefill_is_released_at_the_first_token_and_decode_at_the_end():
    prefill, decode = prefill_and_decode()
    charge = LoadLedger(KvIndex()).charge(40, prefill=prefill, decode=decode)
    charge.release_prefill()
    assert loads(prefill) == [(1, 700, 60)]
    assert loads(decode)[0][0] == 2
    charge.release()
    assert loads(decode) == [(1, 700, 60)]


def test_a_heartbeat_between_charge_and_release_does_not_double_subtract():
    registry = make_registry("prefill", {"p": REPORTED})
    p = registry.get("p")
    ledger = LoadLedger(KvIndex())
    charge = ledger.charge(300, prefill=p)
    assert loads(p) == [(2, 1000, 60)]
    # The heartbeat counts the charged request itself; the charge is no longer added.
    registry.heartbeat("p", InstanceLoad(num_running_requests=2, num_free_blocks=60, num_total_blocks=100,
                                         num_queued_prefill_tokens=1000))
    assert loads(p) == [(2, 1000, 60)]
    charge.release()  # taken off the reported numbers, once
    assert loads(p) == [(1, 700, 60)]
    charge.release()
    assert loads(p) == [(1, 700, 60)]
    registry.heartbeat("p", REPORTED)  # the next heartbeat no longer counts it: nothing more to take off
    assert loads(p) == [(1, 700, 60)]


def test_finishes_seen_since_the_heartbeat_leave_the_estimate_until_the_next_one():
    registry = make_registry("decode", {"d": REPORTED})
    d = registry.get("d")
    ledger = LoadLedger(KvIndex())
    earlier = ledger.charge(16 * 20 - 1, decode=d)  # 20 blocks, counted by the heartbeat below
    registry.heartbeat("d", REPORTED)
    since = ledger.charge(16 * 4 - 1, decode=d)  # 4 blocks
    assert loads(d) == [(2, 700, 56)]
    earlier.release()
    assert loads(d) == [(1, 700, 76)]
    since.release()
    assert loads(d) == [(0, 700, 80)]


def test_the_estimate_is_clamped_to_the_pool():
    # A request that finished just before the heartbeat's snapshot is taken off twice.
    registry = make_registry("decode", {"d": InstanceLoad(num_free_blocks=90, num_total_blocks=100)})
    d = registry.get("d")
    charge = LoadLedger(KvIndex()).charge(16 * 50, decode=d)
    registry.heartbeat("d", InstanceLoad(num_free_blocks=90, num_total_blocks=100))
    charge.release()
    assert loads(d) == [(0, 0, 100)]


def test_a_prefill_charge_nets_out_the_cached_prefix_and_records_the_prompt_as_pending():
    registry = make_registry("prefill", {"a": queued(0)})
    index = KvIndex()
    index.add_instance("a")
    index.apply_events("a", [{"seq": 1, "type": "stored", "block_hashes": [7]}])
    charge = LoadLedger(index).charge(40, prefill=registry.get("a"), prompt_block_hashes=[7, 8])
    assert charge.num_prefill_tokens == 40 - 16
    assert registry.get("a").queued_prefill_tokens == 40 - 16
    assert index.cached_prefix_blocks("a", [7, 8]) == 2
    charge.release()  # the pending blocks stay with the index (until events or their TTL)
    assert index.cached_prefix_blocks("a", [7, 8]) == 2


def test_a_release_after_a_restart_leaves_the_new_instance_alone():
    registry = make_registry("prefill", {"p": REPORTED})
    charge = LoadLedger(KvIndex()).charge(300, prefill=registry.get("p"))
    registry.register(InstanceSpec("p", "prefill", "p:1", block_size=BLOCK, num_total_blocks=100))
    registry.heartbeat("p", REPORTED)
    charge.release()
    assert loads(registry.get("p")) == [(1, 700, 60)]


def test_a_decode_only_charge_has_no_prefill_part():
    registry = make_registry("decode", {"d": REPORTED})
    charge = LoadLedger(KvIndex()).charge(40, decode=registry.get("d"))
    assert charge.prefill is None and charge.num_prefill_tokens == 0
    charge.release_prefill()
    assert loads(registry.get("d"))[0][0] == 2


def test_a_local_prefill_charges_the_decode_its_uncached_prompt_until_the_first_token():
    registry = make_registry("decode", {"d": REPORTED})
    d = registry.get("d")
    index = KvIndex()
    index.add_instance("d")
    index.apply_events("d", [{"seq": 1, "type": "stored", "block_hashes": [7]}])
    charge = LoadLedger(index).charge(40, prompt_block_hashes=[7, 8], decode=d, local_prefill=True)
    # One request, not two: the prefill part counts tokens only.
    assert loads(d) == [(2, 700 + 40 - 16, 60 - decode_blocks_needed(40, BLOCK))]
    assert index.cached_prefix_blocks("d", [7, 8, 9]) == 2  # its blocks are pending there
    charge.release_prefill()
    assert loads(d) == [(2, 700, 60 - decode_blocks_needed(40, BLOCK))]
    charge.release()
    assert loads(d) == [(1, 700, 60)]


def test_a_heartbeat_taken_before_a_local_prefill_ended_does_not_outlive_the_request():
    registry = make_registry("decode", {"d": REPORTED})
    d = registry.get("d")
    charge = LoadLedger(KvIndex()).charge(40, decode=d, local_prefill=True)
    # The instance reports the request waiting, its prompt still to compute.
    registry.heartbeat("d", InstanceLoad(num_running_requests=1, num_waiting_requests=1, num_free_blocks=60,
                                         num_total_blocks=100, num_queued_prefill_tokens=740))
    charge.release_prefill()  # its first token
    charge.release()  # its end, before the next heartbeat
    assert loads(d)[0][:2] == (1, 700)  # without the prefill charge: 740 until the next heartbeat
