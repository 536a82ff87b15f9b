"""Registries of heartbeated instances for the routing tests."""
from __future__ import annotations

from common.service.registration import InstanceLoad, InstanceSpec
from gateway.routing.registry import InstanceRegistry

BLOCK = 16


def make_registry(role, loads):
    """One instance per entry of `loads` (id -> InstanceLoad), heartbeated."""
    registry = InstanceRegistry(clock=lambda: 0.0)
    for instance_id, load in loads.items():
        registry.register(InstanceSpec(instance_id, role, f"{instance_id}:1", block_size=BLOCK,
                                       num_total_blocks=load.num_total_blocks))
        registry.heartbeat(instance_id, load)
    return registry


def queued(tokens, requests=0):
    return InstanceLoad(num_queued_prefill_tokens=tokens, num_waiting_requests=requests)
