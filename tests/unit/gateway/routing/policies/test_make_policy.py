from __future__ import annotations

import pytest

from gateway.routing.kv_index import KvIndex
from gateway.routing.policies import POLICIES, LeastLoaded, PrefixAware, RoundRobin, make_policy


def test_make_policy():
    assert isinstance(make_policy("round_robin"), RoundRobin)
    assert isinstance(make_policy("least_loaded"), LeastLoaded)
    assert isinstance(make_policy("prefix_aware", KvIndex()), PrefixAware)
    assert [make_policy(name, KvIndex()).name for name in POLICIES] == list(POLICIES)
    with pytest.raises(ValueError, match="needs the KV event index"):
        make_policy("prefix_aware")
    with pytest.raises(ValueError, match="unknown placement policy"):
        make_policy("random")
