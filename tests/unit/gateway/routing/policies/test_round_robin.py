from __future__ import annotations

from common.service.registration import InstanceSpec
from gateway.routing.policies import RoundRobin
from tests.unit.gateway.routing.instances import make_registry, queued


def test_round_robin_cycles_and_follows_membership():
    policy = RoundRobin()
    registry = make_registry("prefill", {"a": queued(0), "b": queued(0)})
    picks = [policy.choose_prefill([], registry.instances("prefill")).instance_id for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]
    registry.register(InstanceSpec("c", "prefill", "c:1"))  # scaled up: used at once
    picks = {policy.choose_prefill([], registry.instances("prefill")).instance_id for _ in range(3)}
    assert picks == {"a", "b", "c"}
    assert policy.choose_prefill([], []) is None and policy.choose_decode(1, []) is None
