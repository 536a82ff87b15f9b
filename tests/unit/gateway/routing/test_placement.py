"""choose_remote_prefill: the one place the gateway decides remote or local prefill."""
from __future__ import annotations

from common.engine.block_hash import compute_block_hashes
from common.service.registration import InstanceLoad
from gateway.routing.placement import Placement, choose_remote_prefill
from gateway.routing.policies import LeastLoaded
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
