from __future__ import annotations

from gateway.routing.kv_index import KvIndex
from gateway.routing.load_ledger import LoadLedger
from gateway.routing.policies import LeastLoaded
from tests.unit.gateway.routing.instances import make_registry, queued


def test_least_loaded_sees_dispatches_before_the_next_heartbeat():
    registry = make_registry("prefill", {"a": queued(100), "b": queued(300)})
    policy = LeastLoaded()
    assert policy.choose_prefill([], registry.instances("prefill")).instance_id == "a"
    LoadLedger(KvIndex()).charge(400, prefill=registry.get("a"))
    assert policy.choose_prefill([], registry.instances("prefill")).instance_id == "b"
