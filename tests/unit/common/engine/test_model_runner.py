"""The runner's step threads: a step that prefills enough prompt tokens runs on
--num-prefill-threads, every other step on the process's own threads, and the tokens do
not change."""
from __future__ import annotations

import pytest
import torch

from common.engine.llm import LLM
from common.engine.config import ModelConfig
from common.engine.model_files import load_hf_config
from common.engine import model_runner
from common.engine.model_runner import PREFILL_THREADS_MIN_TOKENS, allocate_paged_kv, step_num_threads
from common.engine.outputs import ScheduledRequest, SchedulerOutput
from common.engine.sampling_params import SamplingParams
from kernels.huge_pages import CHUNK_BYTES, huge_pages_available, populate_in_background
from tests.support.memory_maps import mapping_of


def _step(*token_counts: int, drafts: int = 0) -> SchedulerOutput:
    """A step of requests computing these numbers of tokens (the last `drafts` of each a draft)."""
    scheduled = [ScheduledRequest(f"r{i}", list(range(n)), 0, [0], True, SamplingParams(),
                                  spec_token_ids=list(range(drafts)) if n > drafts else [])
                 for i, n in enumerate(token_counts)]
    return SchedulerOutput(scheduled=scheduled, num_scheduled_tokens=sum(token_counts))


@pytest.mark.parametrize("token_counts, drafts, expected", [
    ((PREFILL_THREADS_MIN_TOKENS,), 0, 3),  # one chunk of the minimum
    ((1, 1, PREFILL_THREADS_MIN_TOKENS // 2, PREFILL_THREADS_MIN_TOKENS // 2), 0, 3),  # chunks add up
    ((PREFILL_THREADS_MIN_TOKENS - 1, 1), 0, None),  # the decode's token is no prompt token
    ((1,) * 64, 0, None),  # a wide decode step: the gateway streams its tokens meanwhile
    ((5,) * 16, 4, None),  # verifying drafts: one known token each
])
def test_prefill_steps_take_the_prefill_threads(token_counts, drafts, expected):
    assert step_num_threads(_step(*token_counts, drafts=drafts), 3) == expected
    assert step_num_threads(_step(*token_counts, drafts=drafts), None) is None


def test_num_prefill_threads_must_be_positive_and_for_one_rank():
    with pytest.raises(ValueError, match="num_prefill_threads must be >= 1"):
        LLM(num_prefill_threads=0)
    with pytest.raises(ValueError, match="num_prefill_threads is for one rank; this engine has 2"):
        LLM(num_prefill_threads=2, pipeline_parallel_size=2)


def test_a_prefill_step_runs_on_the_prefill_threads_and_the_tokens_stay(tiny_llama_dir):
    """The process runs on 1 thread; the steps that prefill a 40-token prompt run on 2, the
    decode steps on 1, and the greedy tokens equal an engine's without the option."""
    threads_before = torch.get_num_threads()
    prompt = {"prompt_token_ids": [(17 * i) % 300 + 5 for i in range(40)]}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    try:
        plain = LLM(model=str(tiny_llama_dir), num_threads=1, kv_cache_memory="16MiB")
        want = plain.generate([prompt], params)[0].outputs[0].token_ids
        plain.engine.shutdown()
        llm = LLM(model=str(tiny_llama_dir), num_threads=1, num_prefill_threads=2, kv_cache_memory="16MiB")
        runner = llm.engine.executor.runner
        run_model = runner._run_model
        step_threads: list[tuple[int, int]] = []  # (tokens, torch threads) of each step

        def recording_run_model(scheduler_output):
            step_threads.append((scheduler_output.num_scheduled_tokens, torch.get_num_threads()))
            return run_model(scheduler_output)

        runner._run_model = recording_run_model
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert got == want
        assert step_threads[0] == (40, 2)
        assert step_threads[1:] and all(step == (1, 1) for step in step_threads[1:])
        assert torch.get_num_threads() == 1  # back to the process's threads after each step
        llm.engine.shutdown()
    finally:
        torch.set_num_threads(threads_before)


def test_an_fp8_pool_holds_twice_the_tokens_of_bf16_and_names_its_codes(tiny_llama_dir):
    """kv_cache_dtype fp8: the same KV memory holds twice bf16's blocks, of E4M3 codes, and
    a request through them leaves every block free again."""
    pools = {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(model=str(tiny_llama_dir), dtype="bfloat16", kv_cache_memory="16MiB", enforce_eager=True,
                  kv_cache_dtype=kv_cache_dtype)
        runner = llm.engine.executor.runner
        pools[kv_cache_dtype] = (llm.engine.config.cache.num_blocks, runner.kv_caches[0][0].dtype,
                                 runner.kv_bytes_per_block)
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        assert len(llm.generate([{"prompt_token_ids": list(range(5, 45))}], params)[0].outputs[0].token_ids) == 5
        assert llm.engine.kv_cache_manager.num_free_blocks == pools[kv_cache_dtype][0]  # all back
        llm.engine.shutdown()
    (bf16_blocks, bf16_dtype, bf16_bytes), (fp8_blocks, fp8_dtype, fp8_bytes) = pools["auto"], pools["fp8"]
    assert (bf16_dtype, fp8_dtype) == (torch.bfloat16, torch.float8_e4m3fn)
    assert fp8_bytes * 2 == bf16_bytes
    assert fp8_blocks == 2 * bf16_blocks


def test_a_step_verifying_drafts_lays_them_out_as_decode_rows(tiny_llama_dir):
    """A request verifying k drafts is k + 1 decode rows (one query token each,
    its block table repeated, each row's keys up to its own position); plain decodes share
    the rows, prefill chunks stay ragged after them; a sample at every row of a verification."""
    llm = LLM(model=str(tiny_llama_dir), kv_cache_memory="16MiB", enforce_eager=True)
    runner = llm.engine.executor.runner
    bs = runner.block_size
    params = SamplingParams()
    prefill = ScheduledRequest("p", [5, 6, 7, 8, 9], 0, [3], True, params)
    verifying = ScheduledRequest("v", [11, 12, 13], bs + 1, [1, 2], True, params, spec_token_ids=[12, 13])
    decode = ScheduledRequest("d", [21], 2, [4], True, params)
    ids, positions, meta, sample_indices, sample_reqs = runner.prepare_inputs([prefill, verifying, decode])
    assert ids.tolist() == [11, 12, 13, 21, 5, 6, 7, 8, 9]
    assert positions.tolist() == [bs + 1, bs + 2, bs + 3, 2, 0, 1, 2, 3, 4]
    assert meta.slot_mapping.tolist() == [2 * bs + 1, 2 * bs + 2, 2 * bs + 3, 4 * bs + 2, *range(3 * bs, 3 * bs + 5)]
    assert meta.num_decode_tokens == 4
    assert meta.seq_lens.tolist() == [bs + 2, bs + 3, bs + 4, 3, 5]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4, 9]
    assert meta.block_tables.tolist() == [[1, 2], [1, 2], [1, 2], [4, 0], [3, 0]]
    assert meta.decode_seq_lens.tolist() == [bs + 2, bs + 3, bs + 4, 3] and meta.max_decode_seq_len == bs + 4
    assert meta.prefill_query_start_loc.tolist() == [0, 5] and meta.prefill_block_tables.tolist() == [[3, 0]]
    assert sample_indices.tolist() == [0, 1, 2, 3, 8]
    assert [r.req_id for r in sample_reqs] == ["v", "d", "p"]
    llm.engine.shutdown()


def test_the_kv_pool_is_zeroed_and_each_layers_caches_are_their_own(tiny_llama_dir):
    # Zeroed: attention reads whole blocks, and a NaN left in a masked slot would survive
    # its zero weight. Unaliased: the compiled graph writes every layer's caches.
    config = ModelConfig.from_hf_config(load_hf_config(tiny_llama_dir))
    caches = allocate_paged_kv(config, 8, 16, torch.bfloat16, torch.device("cpu"))
    assert len(caches) == config.num_hidden_layers
    tensors = [cache for pair in caches for cache in pair]
    for cache in tensors:
        assert cache.shape == (8, 16, config.num_key_value_heads, config.head_dim)
        assert cache.dtype == torch.bfloat16 and cache.is_contiguous() and not cache.any()
    assert len({cache.untyped_storage().data_ptr() for cache in tensors}) == len(tensors)


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages here")
def test_a_cpu_kv_pool_lives_in_huge_pages_faulted_in_on_a_thread(tiny_llama_dir, monkeypatch):
    # A decode step's attention reads blocks scattered over the pool; on 4 KiB pages the
    # TLB caps that read. Nothing is written to make the pool read as zero, and the start
    # does not wait for its pages (kernels/huge_pages.py's tests: the thread faults them in).
    populated = []

    def populate(tensors, stop=None):
        populated.extend(tensors)
        return populate_in_background(tensors, stop)

    monkeypatch.setattr(model_runner, "populate_in_background", populate)
    config = ModelConfig.from_hf_config(load_hf_config(tiny_llama_dir))
    caches = allocate_paged_kv(config, 16384, 16, torch.float32, torch.device("cpu"))
    tensors = [cache for pair in caches for cache in pair]
    assert [t.data_ptr() for t in populated] == [t.data_ptr() for t in tensors]
    big = caches[0][0]  # 16384 x 16 x kv heads x head dim x 4 bytes: a region of its own
    assert big.untyped_storage().nbytes() > CHUNK_BYTES // 2
    assert all(mapping_of(t)["THPeligible"] == "1" and not t.any() for t in tensors)


def test_a_kv_pool_replaced_or_shut_down_is_faulted_in_no_further(tiny_llama_dir, monkeypatch):
    stops = []

    def populate(tensors, stop=None):
        stops.append(stop)
        return None

    monkeypatch.setattr(model_runner, "populate_in_background", populate)
    llm = LLM(model=str(tiny_llama_dir), kv_cache_memory="16MiB", enforce_eager=True)
    runner = llm.engine.executor.runner
    first = runner.kv_populating_stop
    assert stops == [first] and not first.is_set()
    runner.allocate_kv_cache(8)
    assert first.is_set()
    assert stops[-1] is runner.kv_populating_stop and not runner.kv_populating_stop.is_set()
    llm.engine.shutdown()
    assert runner.kv_populating_stop.is_set()


def _mlp_rows_per_step(llm: LLM) -> list[list[int]]:
    """Hooks each layer's MLP; returns the list each step's forward fills with the rows every
    layer's MLP ran on, in layer order (one list a forward pass)."""
    layers = llm.engine.executor.runner.model.layers
    passes: list[list[int]] = []

    def record(module, args):
        if module is layers[0].mlp:
            passes.append([])
        passes[-1].append(args[0].shape[0])

    for layer in layers:
        layer.mlp.register_forward_pre_hook(record)
    return passes


def test_the_last_layer_goes_on_with_the_sampled_rows_alone(tiny_llama_dir):
    """A prompt step's last layer runs its MLP over the rows it samples (one a finishing
    prompt), the other layers over every token; asking for prompt logprobs keeps every row,
    and the tokens and their logprobs are the same either way."""
    prompts = [{"prompt_token_ids": [(11 * i + 3 * n) % 300 + 5 for i in range(n)]} for n in (30, 12)]
    llm = LLM(model=str(tiny_llama_dir), kv_cache_memory="16MiB")
    try:
        passes = _mlp_rows_per_step(llm)
        num_layers = len(llm.engine.executor.runner.model.layers)
        kept = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2))
        assert passes[0] == [42] * (num_layers - 1) + [2]
        llm.reset_prefix_cache()
        passes.clear()
        every_row = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                         logprobs=2, prompt_logprobs=1))
        assert passes[0] == [42] * num_layers
        assert all(len(o.prompt_logprobs) == len(p["prompt_token_ids"]) for o, p in zip(every_row, prompts))
        for got, want in zip(kept, every_row):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            torch.testing.assert_close(torch.tensor([lp.token_logprob for lp in got.outputs[0].logprobs]),
                                       torch.tensor([lp.token_logprob for lp in want.outputs[0].logprobs]),
                                       atol=1e-5, rtol=0)
    finally:
        llm.engine.shutdown()


def test_a_step_that_samples_nothing_runs_its_last_layer_on_one_row(tiny_llama_dir):
    """A 40-token prompt in 16-token chunks: the first two steps finish no prompt, so no row
    of theirs is read, and their last layer goes on with one row (no empty tensor); the
    third samples the prompt's first token, the same as unchunked."""
    prompt = {"prompt_token_ids": [(13 * i) % 300 + 5 for i in range(40)]}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    whole = LLM(model=str(tiny_llama_dir), kv_cache_memory="16MiB")
    want = whole.generate([prompt], params)[0].outputs[0].token_ids
    whole.engine.shutdown()
    llm = LLM(model=str(tiny_llama_dir), kv_cache_memory="16MiB", max_num_batched_tokens=16)
    try:
        passes = _mlp_rows_per_step(llm)
        num_layers = len(llm.engine.executor.runner.model.layers)
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == want
        assert passes[:3] == [[16] * (num_layers - 1) + [1], [16] * (num_layers - 1) + [1],
                              [8] * (num_layers - 1) + [1]]
    finally:
        llm.engine.shutdown()
