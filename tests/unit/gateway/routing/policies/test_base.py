from __future__ import annotations

from common.service.registration import InstanceLoad
from gateway.routing.kv_index import KvIndex
from gateway.routing.load_ledger import LoadLedger, decode_blocks_needed
from gateway.routing.policies import choose_decode_by_load
from tests.unit.gateway.routing.instances import BLOCK, make_registry


def test_decode_choice_by_free_blocks_and_requests():
    def decode(free, running):
        return InstanceLoad(num_free_blocks=free, num_total_blocks=100, num_running_requests=running)
    registry = make_registry("decode", {"a": decode(50, 3), "b": decode(10, 1), "c": decode(80, 3)})
    instances = registry.instances("decode")
    assert decode_blocks_needed(160, BLOCK) == 11
    assert choose_decode_by_load(100, instances).instance_id == "b"  # fits, fewest requests
    assert choose_decode_by_load(200, instances).instance_id == "c"  # b cannot hold 13 blocks
    assert choose_decode_by_load(5000, instances).instance_id == "c"  # none fits: most free
    LoadLedger(KvIndex()).charge(1000, decode=registry.get("c"))
    assert registry.get("c").free_blocks == 80 - 63
    assert choose_decode_by_load(1, []) is None
