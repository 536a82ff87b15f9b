"""LoRA adapters over ranks: an engine split by tensor or pipeline parallelism (real worker
processes, gloo on 127.0.0.1) gives the one-process engine's greedy tokens and logprobs for
each adapter and for a batch mixing two adapters and the base model; an adapter the ranks
refuse fails with the adapter's own message and leaves no rank holding it; one loaded at
run time replaces its name's weights on every rank."""
from __future__ import annotations

import pytest

from common.engine.llm import LLM
from common.engine.lora.request import LoRARequest
from common.engine.sampling_params import SamplingParams

from tests.support.peft_adapters import make_adapter, requires_peft

pytestmark = [pytest.mark.slow, requires_peft]

PROMPTS = [list(range(10, 30)), list(range(300, 309)), [5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
# fp32; the ranks sum partial matmuls in another order than one process.
LOGPROB_ATOL = 1e-3
# A step budget below the prompts' lengths: steps mix prefill chunks and decodes.
ENGINE = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_memory="16MiB",
              max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def base_dir(tiny_model_factory):
    return tiny_model_factory("tiny-llama", "llama")  # 4 query heads, 2 KV heads, 2 layers


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    # b targets some linears only, at another rank, with rsLoRA's scaling.
    return {"a": LoRARequest("a", 1, make_adapter(base_dir, root / "a", seed=1)[0]),
            "b": LoRARequest("b", 2, make_adapter(base_dir, root / "b", seed=2,
                                                  targets=("q_proj", "v_proj", "down_proj"), rank=8, alpha=4,
                                                  use_rslora=True)[0]),
            "a2": LoRARequest("a", 1, make_adapter(base_dir, root / "a2", seed=3)[0])}


def generate(llm: LLM, lora_requests: list[LoRARequest | None]) -> list[tuple[list[int], list[float]]]:
    results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=lora_requests)
    return [(r.outputs[0].token_ids, [lp.token_logprob for lp in r.outputs[0].logprobs]) for r in results]


def assert_same(got, want) -> None:
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, got_logprobs), (_, want_logprobs) in zip(got, want):
        assert got_logprobs == pytest.approx(want_logprobs, abs=LOGPROB_ATOL)


@pytest.fixture(scope="module")
def expected(base_dir, adapters):
    """One process's outputs: each adapter alone, a mixed batch, the reloaded adapter."""
    single = LLM(str(base_dir), **ENGINE)
    try:
        runs = {name: generate(single, [adapters[name]] * len(PROMPTS)) for name in ("a", "b")}
        runs["mixed"] = generate(single, [adapters["b"], None, adapters["a"]])
        runs["base"] = generate(single, [None] * len(PROMPTS))
        single.engine.load_lora(adapters["a2"])
        runs["a2"] = generate(single, [adapters["a2"]] * len(PROMPTS))
        return runs
    finally:
        single.engine.shutdown()


@pytest.mark.parametrize("tensor_parallel_size, pipeline_parallel_size", [(2, 1), (1, 2)])
def test_ranks_split_by_tensor_or_pipeline_give_the_single_rank_adapters_tokens(
        base_dir, adapters, expected, tensor_parallel_size, pipeline_parallel_size, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the ranks take their own share, as in production
    llm = LLM(str(base_dir), **ENGINE, tensor_parallel_size=tensor_parallel_size,
              pipeline_parallel_size=pipeline_parallel_size)
    try:
        for name in ("a", "b"):
            assert_same(generate(llm, [adapters[name]] * len(PROMPTS)), expected[name])
            assert expected[name] != expected["base"]  # the adapter changed something
        assert_same(generate(llm, [adapters["b"], None, adapters["a"]]), expected["mixed"])

        # Refused on the ranks: the adapter's own message, the engine and its adapters as they were.
        with pytest.raises(ValueError, match="no adapter_config.json"):
            llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY,
                         lora_request=LoRARequest("missing", 3, str(tmp_path / "missing")))
        assert not llm.engine.has_unfinished_requests()
        assert list(llm.engine._held_loras) == ["b", "a"]
        assert llm.engine.executor.collective_rpc("lora_names") == [["a", "b"]] * 2

        llm.engine.load_lora(adapters["a2"])  # same name, other weights: every rank's "a" replaced
        assert_same(generate(llm, [adapters["a2"]] * len(PROMPTS)), expected["a2"])
        assert expected["a2"] != expected["a"]
    finally:
        llm.engine.shutdown()
