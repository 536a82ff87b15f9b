"""Placement policies by name: one per module, all behind policies.base.PlacementPolicy."""
from __future__ import annotations

from gateway.routing.kv_index import KvIndex
from gateway.routing.policies.base import PlacementPolicy, choose_decode_by_load
from gateway.routing.policies.least_loaded import LeastLoaded
from gateway.routing.policies.prefix_aware import DEFAULT_KV_LOAD_WEIGHT, PrefixAware
from gateway.routing.policies.round_robin import RoundRobin

POLICIES = ("round_robin", "least_loaded", "prefix_aware")

__all__ = ["DEFAULT_KV_LOAD_WEIGHT", "POLICIES", "LeastLoaded", "PlacementPolicy", "PrefixAware", "RoundRobin",
           "choose_decode_by_load", "make_policy"]


def make_policy(name: str, kv_index: KvIndex | None = None, load_weight: float = 1.0,
                kv_load_weight: float = DEFAULT_KV_LOAD_WEIGHT) -> PlacementPolicy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_aware":
        if kv_index is None:
            raise ValueError("prefix_aware placement needs the KV event index")
        return PrefixAware(kv_index, load_weight, kv_load_weight=kv_load_weight)
    raise ValueError(f"unknown placement policy {name!r}; choose from {', '.join(POLICIES)}")
