"""choose_remote_prefill: the one place the gateway decides remote or local prefill."""
from __future__ import annotations

import dataclasses

from common.engine.block_hash import compute_block_hashes, root_parent_hash
from common.service.registration import InstanceLoad
from gateway.routing.placement import Placement, choose_remote_prefill, serving
from gateway.routing.kv_index import KvIndex
from gateway.routing.policies import LeastLoaded, PrefixAware
from tests.unit.gateway.routing.instances import BLOCK, make_registry, queued

PROMPT = list(range(100, 140))


def test_a_live_prefill_instance_prefills_remotely():
    prefills = make_registry("prefill", {"a": queued(500), "b": queued(0)}).instances("prefill")
    prefill, hashes = choose_remote_prefill(LeastLoaded(), prefills, PROMPT)
    assert prefill.instance_id == "b"
    assert list(hashes) == list(compute_block_hashes(PROMPT, BLOCK))
    decode = make_registry("decode", {"d": InstanceLoad()}).get("d")
    placement = Placement(decode, prefill, hashes)
    assert (placement.prefill_address, placement.prefill_instance_id) == ("b:1", "b")


def test_no_prefill_instance_alive_means_the_decode_instance_prefills_locally():
    assert choose_remote_prefill(LeastLoaded(), [], PROMPT) == (None, ())
    decode = make_registry("decode", {"d": InstanceLoad()}).get("d")
    placement = Placement(decode, None)
    assert (placement.prefill_address, placement.prefill_instance_id) == ("", "")


def test_a_salted_prompt_is_hashed_from_its_salt_and_placed_by_its_salts_blocks():
    prefills = make_registry("prefill", {"a": queued(0), "b": queued(0)}).instances("prefill")
    salted = compute_block_hashes(PROMPT, BLOCK, root_parent_hash("tenant-a"))
    assert list(choose_remote_prefill(LeastLoaded(), prefills, PROMPT, "tenant-a")[1]) == salted
    assert salted != compute_block_hashes(PROMPT, BLOCK)
    index = KvIndex()
    for instance_id in ("a", "b"):
        index.add_instance(instance_id)
    index.apply_events("b", [{"seq": 1, "type": "stored", "block_hashes": salted}])  # b caches tenant-a's
    policy = PrefixAware(index)
    assert choose_remote_prefill(policy, prefills, PROMPT, "tenant-a")[0].instance_id == "b"
    assert policy.prefill_cost(prefills[1], salted) == 0
    for other in (None, "tenant-b"):  # the same tokens under another salt are not cached there
        hashes = choose_remote_prefill(policy, prefills, PROMPT, other)[1]
        assert policy.prefill_cost(prefills[1], hashes) == len(hashes) * BLOCK > 0


def test_an_adapters_requests_are_placed_on_its_instances_and_hashed_from_its_root():
    registry = make_registry("prefill", {"a": queued(0), "b": queued(0)})
    for instance_id, names in (("a", ("sql",)), ("b", ())):
        instance = registry.get(instance_id)
        instance.spec = dataclasses.replace(instance.spec, lora_names=names)
    prefills = registry.instances("prefill")
    assert [i.instance_id for i in serving(prefills, "sql")] == ["a"]
    assert serving(prefills, "other") == [] and serving(prefills, None) == prefills
    hashes = choose_remote_prefill(LeastLoaded(), serving(prefills, "sql"), PROMPT, None, "sql")[1]
    assert list(hashes) == compute_block_hashes(PROMPT, BLOCK, root_parent_hash(None, "sql")) != \
        compute_block_hashes(PROMPT, BLOCK)


def test_a_prefill_instance_whose_queue_is_full_takes_no_more_prompts():
    registry = make_registry("prefill", {"a": queued(0), "b": queued(600)})
    prefills = registry.instances("prefill")
    # Without a limit the policy may pick either; with one, b (600 queued) is out.
    assert choose_remote_prefill(LeastLoaded(), prefills, PROMPT, max_prefill_queue_tokens=600)[0].instance_id == "a"
    assert choose_remote_prefill(LeastLoaded(), prefills, PROMPT, max_prefill_queue_tokens=601)[0].instance_id == "a"
    registry.heartbeat("a", queued(700))
    # Every queue full: the decode instance prefills (no address, no hashes to charge).
    assert choose_remote_prefill(LeastLoaded(), prefills, PROMPT, max_prefill_queue_tokens=600) == (None, ())
    assert choose_remote_prefill(LeastLoaded(), prefills, PROMPT, max_prefill_queue_tokens=701)[0].instance_id \
        == "b"
    # 0 is no limit: however deep the queues, a live prefill instance prefills.
    assert choose_remote_prefill(LeastLoaded(), prefills, PROMPT)[0].instance_id == "b"


def test_the_queue_limit_counts_what_the_gateway_charged_since_the_last_heartbeat_not_the_new_prompt():
    from gateway.routing.load_ledger import LoadLedger
    registry = make_registry("prefill", {"a": queued(0)})
    prefills = registry.instances("prefill")
    long_prompt = list(range(2_000))
    # A prompt longer than the limit still goes to an idle instance: its own tokens do not count.
    prefill, hashes = choose_remote_prefill(LeastLoaded(), prefills, long_prompt, max_prefill_queue_tokens=512)
    assert prefill.instance_id == "a"
    charge = LoadLedger(KvIndex()).charge(len(long_prompt), prefill=prefill, prompt_block_hashes=hashes)
    # Charged and not yet reported: the next prompt sees a's queue full.
    assert choose_remote_prefill(LeastLoaded(), prefills, PROMPT, max_prefill_queue_tokens=512) == (None, ())
    charge.release_prefill()  # its first token came back: the prefill is done
    assert choose_remote_prefill(LeastLoaded(), prefills, PROMPT, max_prefill_queue_tokens=512)[0] is prefill
