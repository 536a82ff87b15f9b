"""Engine behaviour on a tiny random Llama: outputs must not depend on how the work is cut."""
from __future__ import annotations

import asyncio
import os
import random

import pytest

from common import LLM, SamplingParams
from common.engine.async_engine import AsyncEngine
from common.engine.python_arenas import arena_cache_counts
from common.engine.request import Request
from kernels.cpu.build import find_compiler

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture
def make_llm(tiny_llama_dir):
    made: list[LLM] = []

    def make(**kwargs) -> LLM:
        kwargs.setdefault("num_kv_blocks", 128)
        kwargs.setdefault("block_size", 8)
        llm = LLM(model=str(tiny_llama_dir), **kwargs)
        made.append(llm)
        return llm
    yield make
    # Every test ends with every block free (cached prefixes may stay, unreferenced).
    for llm in made:
        manager = llm.engine.kv_cache_manager
        manager.check_invariants()
        assert manager.num_free_blocks == llm.engine.config.cache.num_blocks
        assert not llm.engine.has_unfinished_requests()


def random_prompts(lengths, seed=0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(n)]} for n in lengths]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_chunked_prefill_does_not_change_outputs(make_llm):
    prompts = random_prompts([3, 40, 97, 150, 9])
    whole = make_llm(enable_chunked_prefill=False, max_num_batched_tokens=512)
    chunked = make_llm(max_num_batched_tokens=16)
    assert token_ids(chunked.generate(prompts, GREEDY)) == token_ids(whole.generate(prompts, GREEDY))


def test_long_prefill_token_threshold_does_not_change_outputs(make_llm):
    prompts = random_prompts([3, 40, 97, 150, 9])
    whole = make_llm(max_num_batched_tokens=512)
    capped = make_llm(max_num_batched_tokens=512, long_prefill_token_threshold=24)
    assert token_ids(capped.generate(prompts, GREEDY)) == token_ids(whole.generate(prompts, GREEDY))


def test_prefix_cache_hit_does_not_change_outputs(make_llm):
    shared = random_prompts([64], seed=1)[0]["prompt_token_ids"]
    prompts = [{"prompt_token_ids": shared + tail["prompt_token_ids"]}
               for tail in random_prompts([5, 12, 1], seed=2)]
    cold = make_llm(enable_prefix_caching=False)
    expected = token_ids(cold.generate(prompts, GREEDY))
    warm = make_llm()
    warm.generate(prompts[:1], GREEDY)
    hits = warm.generate(prompts, GREEDY)
    assert token_ids(hits) == expected
    assert all(o.num_cached_tokens >= 64 for o in hits)
    assert warm.engine.kv_cache_manager.stats.num_hit_tokens > 0


def test_reset_prefix_cache_makes_the_next_prompt_compute_in_full(make_llm):
    prompt = random_prompts([40], seed=3)
    llm = make_llm()
    first = llm.generate(prompt, GREEDY)
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 32  # the full blocks of 8
    llm.reset_prefix_cache()
    again = llm.generate(prompt, GREEDY)
    assert again[0].num_cached_tokens == 0
    assert token_ids(again) == token_ids(first)
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 32  # cached again from the full run


def test_preemption_does_not_change_outputs(make_llm):
    prompts = random_prompts([30, 31, 29, 33, 28, 30])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = make_llm()
    tight = make_llm(num_kv_blocks=16, max_model_len=64)  # 128 token slots for ~330 needed
    assert token_ids(tight.generate(prompts, params)) == token_ids(roomy.generate(prompts, params))
    assert tight.engine.scheduler.stats["num_preemptions"] > 0


def run_resumed(llm: LLM, prompt_token_ids: list[int], params: SamplingParams, resumed: list[int]) -> list[int]:
    """The tokens a request resumed after `resumed` of output produces (a migrated request)."""
    core = llm.engine
    core.add_request(Request("resumed", prompt_token_ids, params, output_token_ids=resumed))
    new_token_ids = []
    while core.has_unfinished_requests():
        new_token_ids += [t for output in core.step() for t in output.new_token_ids]
    return new_token_ids


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    # Per-step seeds, penalties and min_tokens all count the resumed output as output.
    SamplingParams(temperature=1.0, top_p=0.9, seed=77, frequency_penalty=0.8, presence_penalty=0.5,
                   repetition_penalty=1.3, min_tokens=12, max_tokens=16),
], ids=["greedy", "seeded-penalties"])
@pytest.mark.parametrize("num_resumed", [1, 9])
def test_a_request_resumed_after_part_of_its_output_continues_it_exactly(make_llm, params, num_resumed):
    llm = make_llm()
    prompt = random_prompts([21], seed=8)[0]
    whole = llm.generate([prompt], params)[0].outputs[0].token_ids
    llm.reset_prefix_cache()  # the resumed request recomputes everything, as on another instance
    continued = run_resumed(llm, prompt["prompt_token_ids"], params, whole[:num_resumed])
    assert whole[:num_resumed] + continued == whole
    assert len(continued) == params.max_tokens - num_resumed  # max_tokens counted the resumed output


def test_seeded_sampling_is_independent_of_batch(make_llm):
    llm = make_llm()
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(random_prompts([20]), seeded)[0].outputs[0].token_ids
    others = random_prompts([7, 50, 20, 3], seed=5)
    batch = [others[0], random_prompts([20])[0], others[1], others[2]]
    params = [SamplingParams(temperature=0.7, max_tokens=5), seeded, GREEDY,
              SamplingParams(temperature=1.3, seed=9, max_tokens=30)]
    assert llm.generate(batch, params)[1].outputs[0].token_ids == alone


def test_max_model_len_beyond_kv_capacity_fails_with_the_fix(tiny_llama_dir):
    with pytest.raises(ValueError) as err:
        LLM(model=str(tiny_llama_dir), num_kv_blocks=4, block_size=8, max_model_len=100)
    message = str(err.value)
    for expected in ("max_model_len=100", "32 tokens", "--kv-cache-memory", "--max-model-len"):
        assert expected in message


def test_max_model_len_defaults_to_capacity(make_llm):
    assert make_llm(num_kv_blocks=8).max_model_len == 64  # model limit 512, pool 8 x 8


@pytest.mark.skipif(find_compiler() is None or os.environ.get("PDSERVE_KEEP_PY_ARENAS") == "0",
                    reason="the arena cache is compiled, and on by default")
def test_an_engine_process_keeps_the_interpreters_freed_arenas(make_llm):
    make_llm(num_kv_blocks=8)
    assert arena_cache_counts() is not None  # tests/unit/common/engine/test_python_arenas.py: what it does


def test_prompt_longer_than_model_len_names_both_lengths(make_llm):
    llm = make_llm(num_kv_blocks=8)
    with pytest.raises(ValueError, match=r"65 tokens.*64 tokens"):
        llm.generate(random_prompts([65]), GREEDY)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(random_prompts([5, 6]), [GREEDY])


def test_stop_string_and_n(make_llm):
    llm = make_llm()
    full = llm.generate(random_prompts([10]), GREEDY)[0].outputs[0]
    assert len(full.text) > 3
    stop = full.text[2:4]
    stopped = llm.generate(random_prompts([10]), GREEDY.clone(stop=[stop]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == full.text[:full.text.index(stop)]
    many = llm.generate(random_prompts([10]), SamplingParams(n=3, seed=7, max_tokens=6, ignore_eos=True))
    assert [o.index for o in many[0].outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in many[0].outputs}) > 1


def run_async(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_async_engine_streams_and_cancellation_frees_blocks(make_llm):
    llm = make_llm()
    engine = AsyncEngine(llm.engine)
    prompts = random_prompts([12, 30, 5])
    try:
        async def collect(i, prompt):
            req = Request(f"r{i}", prompt["prompt_token_ids"], GREEDY)
            return [tok async for out in engine.generate(req) for tok in out.new_token_ids]

        async def cancel_midway():
            req = Request("cancel-me", prompts[1]["prompt_token_ids"],
                          SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True))
            async for out in engine.generate(req):
                if len(req.output_token_ids) >= 3:
                    break  # closing the iterator aborts the request

        async def main():
            results = await asyncio.gather(*(collect(i, p) for i, p in enumerate(prompts)), cancel_midway())
            # The abort is applied on the engine thread: wait for it, with a deadline.
            await wait_until(lambda: engine.stats["num_running"] == 0 and engine.stats["num_waiting"] == 0)
            return results[:3]

        streamed = run_async(main())
        assert streamed == token_ids(llm.generate(prompts, GREEDY))
    finally:
        engine.shutdown()


def test_async_engine_rejects_duplicate_ids_and_bad_requests(make_llm):
    llm = make_llm(num_kv_blocks=8)
    engine = AsyncEngine(llm.engine)
    try:
        async def main():
            first = engine.generate(Request("dup", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True)))
            await first.__anext__()
            with pytest.raises(ValueError, match="already in flight"):
                await engine.generate(Request("dup", [5], GREEDY)).__anext__()
            with pytest.raises(ValueError, match="97 prompt tokens, more than the 64"):
                await engine.generate(Request("long", list(range(3, 100)), GREEDY)).__anext__()
            await first.aclose()
            await wait_until(lambda: engine.stats["num_running"] == 0)
        run_async(main())
    finally:
        engine.shutdown()


async def wait_until(predicate, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached before the deadline")
        await asyncio.sleep(0.01)


def test_blocks_taken_ahead_change_no_output(make_llm):
    """A request's KV in runs of blocks taken ahead (CacheConfig.num_blocks_ahead) gives the
    tokens it gives one block at a time; the step observer sees the free slots each request
    holds past its tokens."""
    prompts = random_prompts([3, 40, 97, 150, 9])
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    results = {}
    for num_ahead in (0, 7):
        llm = make_llm(num_kv_blocks_ahead=num_ahead)
        block_size = llm.engine.config.cache.block_size
        slack: list[int] = []
        llm.engine.step_observer = lambda output, _seconds: slack.extend(
            len(r.block_table) * block_size - (r.start_pos + len(r.token_ids)) for r in output.scheduled)
        results[num_ahead] = (token_ids(llm.generate(prompts, params)), max(slack))
    assert results[7][0] == results[0][0]
    assert results[0][1] < 8 <= results[7][1]  # one block's slots at most, against runs of them


def test_in_a_pool_too_small_for_the_load_blocks_ahead_change_no_schedule(make_llm):
    """A pool of 48 blocks of 8 for ~600 tokens of KV: requests are preempted and recomputed.
    Blocks held ahead go back before anything would wait or be preempted for them, so the
    steps, the preemptions and the tokens are those of one block at a time."""
    prompts = random_prompts([3, 40, 97, 150, 9], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    results = {}
    for num_ahead in (0, 7):
        llm = make_llm(num_kv_blocks=48, num_kv_blocks_ahead=num_ahead)
        steps: list[list[tuple[int, int]]] = []  # each step's (request by first appearance, tokens)
        order: dict[str, int] = {}
        llm.engine.step_observer = lambda output, _seconds: steps.append(
            [(order.setdefault(r.req_id, len(order)), len(r.token_ids)) for r in output.scheduled])
        outputs = token_ids(llm.generate(prompts, params))
        results[num_ahead] = (outputs, steps, llm.engine.scheduler.num_preemptions)
    assert results[0][2] > 0  # the pool is short: the test is about preemption
    assert results[7] == results[0]
