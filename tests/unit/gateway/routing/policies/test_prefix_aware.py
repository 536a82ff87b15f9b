from __future__ import annotations

from gateway.routing.kv_index import KvIndex
from gateway.routing.load_ledger import LoadLedger
from gateway.routing.policies import PrefixAware, make_policy
from tests.unit.gateway.routing.instances import BLOCK, make_registry, queued


def index_of(*instance_ids):
    index = KvIndex()
    for instance_id in instance_ids:
        index.add_instance(instance_id)
    return index


def test_prefix_aware_trades_cached_prefix_against_queued_tokens():
    index = index_of("a", "b")
    prompt = list(range(1, 33))  # 32 blocks = 512 tokens
    index.apply_events("a", [{"seq": 1, "type": "stored", "block_hashes": prompt[:30]}])
    policy = PrefixAware(index)
    # cost = uncached tokens + queued tokens: a = 2*16 + Q_a, b = 32*16 + Q_b
    registry = make_registry("prefill", {"a": queued(400), "b": queued(0)})
    chosen = policy.choose_prefill(prompt, registry.instances("prefill"))
    assert chosen.instance_id == "a" and policy.prefill_cost(chosen, prompt) == 432
    registry = make_registry("prefill", {"a": queued(481), "b": queued(0)})  # 513 > 512
    assert policy.choose_prefill(prompt, registry.instances("prefill")).instance_id == "b"
    registry = make_registry("prefill", {"a": queued(480, requests=1), "b": queued(0)})  # tie: fewer requests
    assert policy.choose_prefill(prompt, registry.instances("prefill")).instance_id == "b"
    assert policy.choose_prefill(prompt, []) is None


def test_prefix_aware_spreads_uncached_prompts_to_the_emptier_cache():
    # Idle pool, nobody caches the prompt: the instance caching fewer blocks wins, so
    # new tenants do not all pile onto the lowest id and evict each other there.
    index = index_of("a", "b")
    index.apply_events("a", [{"seq": 1, "type": "stored", "block_hashes": [101, 102, 103]}])
    index.apply_events("b", [{"seq": 1, "type": "stored", "block_hashes": [201]}])
    policy = PrefixAware(index)
    registry = make_registry("prefill", {"a": queued(0), "b": queued(0)})
    tenant_1, tenant_2 = [1, 2, 3, 4], [5, 6, 7, 8]
    first = policy.choose_prefill(tenant_1, registry.instances("prefill"))
    assert first.instance_id == "b"
    # A dispatch counts as cached at once (pending), before its events arrive.
    index.record_dispatch("b", tenant_1)
    assert index.num_cached_blocks("b") == 5
    assert policy.choose_prefill(tenant_2, registry.instances("prefill")).instance_id == "a"
    # The cached prefix still outranks the tie-break.
    assert policy.choose_prefill(tenant_1, registry.instances("prefill")).instance_id == "b"


def test_a_finished_prefill_stops_pushing_its_tenant_off_the_instance_that_caches_it():
    # prefill-a caches the tenant's 32-block system prompt and has just prefilled the
    # tenant's previous request (600 tokens charged at dispatch); b is idle and caches nothing.
    registry = make_registry("prefill", {"a": queued(0), "b": queued(0)})
    index = index_of("a", "b")
    ledger = LoadLedger(index)
    system_prompt = list(range(1000, 1032))
    index.apply_events("a", [{"seq": 1, "type": "stored", "block_hashes": system_prompt}])
    policy = PrefixAware(index)
    previous = ledger.charge(600, prefill=registry.get("a"), prompt_block_hashes=system_prompt + [1, 2, 3, 4, 5, 6, 7])
    assert previous.num_prefill_tokens == 600 - 32 * BLOCK
    next_request = system_prompt + [8, 9, 10, 11, 12, 13]
    # While that prefill is counted, a costs 6 blocks + 88 queued tokens + 1 request more than b's 38 blocks.
    assert policy.choose_prefill(next_request, registry.instances("prefill")).instance_id == "a"
    uncached = ledger.charge(600, prefill=registry.get("a"))  # a second, uncached prompt queued behind it
    assert policy.choose_prefill(next_request, registry.instances("prefill")).instance_id == "b"
    # Both finished (the gateway saw their first tokens): the tenant stays where its prefix is,
    # without waiting for a's next heartbeat.
    previous.release()
    uncached.release()
    assert registry.get("a").queued_prefill_tokens == 0
    assert policy.choose_prefill(next_request, registry.instances("prefill")).instance_id == "a"


def test_a_decode_that_prefills_itself_is_chosen_by_cached_prefix_against_the_kv_its_requests_hold():
    from common.service.registration import InstanceLoad
    index = index_of("a", "b")
    prompt = list(range(1, 33))  # 32 blocks = 512 tokens
    index.apply_events("a", [{"seq": 1, "type": "stored", "block_hashes": prompt[:30]}])
    dynamo = PrefixAware(index, kv_load_weight=1.0)  # a KV token held weighs one prompt token

    def decodes(a_used_blocks: int, b_used_blocks: int = 0):
        loads = {i: InstanceLoad(num_free_blocks=100 - used, num_total_blocks=100, num_running_requests=used // 10)
                 for i, used in (("a", a_used_blocks), ("b", b_used_blocks))}
        return make_registry("decode", loads).instances("decode")
    # cost = uncached tokens + KV tokens held: a = 2*16 + 16*used_a, b = 32*16
    assert dynamo.choose_decode_for_local_prefill(prompt, 512, decodes(a_used_blocks=29)).instance_id == "a"
    assert dynamo.choose_decode_for_local_prefill(prompt, 512, decodes(a_used_blocks=31)).instance_id == "b"
    # By default a KV token weighs a tenth: a = 2*16 + 1.6*used_a, b = 32*16 + 1.6*used_b.
    policy = PrefixAware(index)
    assert policy.choose_decode_for_local_prefill(prompt, 512, decodes(a_used_blocks=60)).instance_id == "a"
    # Never where the prompt's KV does not fit while another instance has room for it.
    assert policy.choose_decode_for_local_prefill(prompt, 512, decodes(a_used_blocks=70)).instance_id == "b"
    assert PrefixAware(index, kv_load_weight=0.5).choose_decode_for_local_prefill(
        prompt, 512, decodes(a_used_blocks=60)).instance_id == "b"
    # The base policies place by load alone, as for a remote prefill.
    least_loaded = make_policy("least_loaded", index)
    assert least_loaded.choose_decode_for_local_prefill(prompt, 512, decodes(a_used_blocks=10)).instance_id == "b"
