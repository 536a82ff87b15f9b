"""Decode steps replayed from captured graphs: same tokens as the plain forward, padding
rows that touch nothing, the steps a graph must not serve.

CUDA graphs cannot be captured on a CPU, so the CPU tests capture with a stand-in that
re-runs the same function over the same static buffers on replay: what they check is the
buffer handling (copies in, padding, the output view), which is the same on both. The
CUDA test runs the real capture where a GPU is present (scripts/gpu_check.sh)."""
from __future__ import annotations

import pytest
import torch

from common.engine.cuda_graphs import DecodeGraphs, batch_size_buckets
from common.engine.llm import LLM
from common.engine.models.attention import AttentionMetadata
from common.engine.sampling_params import SamplingParams
from common.engine.spec_decode.proposer import DraftProposer

MAX_NUM_SEQS = 8


def rerun_capture(fn, pool):
    """A replay that runs fn again over the same buffers (what a graph replays)."""
    outputs = fn()

    def replay() -> None:
        for static, new in zip(outputs, fn()):
            static.copy_(new)
    return replay, outputs, pool


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("tiny-llama", "llama")), dtype="float32", enforce_eager=True,
              max_num_seqs=MAX_NUM_SEQS, kv_cache_memory="64MiB")
    yield llm
    llm.engine.shutdown()


def _runner(llm):
    return llm.engine.executor.runner


def _graphs(runner, llm) -> DecodeGraphs:
    graphs = DecodeGraphs(runner.forward, runner.kv_caches, runner.device, MAX_NUM_SEQS, llm.max_model_len,
                          runner.block_size, capture=rerun_capture, compute_logits=runner.compute_logits)
    graphs.capture_all()
    return graphs


def _prompts(lengths: list[int]) -> list[dict]:
    return [{"prompt_token_ids": [(11 * i + 7 * n) % 700 + 40 for i in range(n)]} for n in lengths]


@pytest.mark.parametrize("max_num_seqs, buckets", [
    (1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]), (64, [1, 2, 4, 8, 16, 24, 32, 40, 48,
                                                                                   56, 64])])
def test_batch_size_buckets(max_num_seqs, buckets):
    assert batch_size_buckets(max_num_seqs) == buckets


@pytest.mark.parametrize("batch", [1, 3, 5, 8])
def test_replayed_decodes_give_the_same_tokens(llm, batch, monkeypatch):
    runner = _runner(llm)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompts = _prompts([3 + 9 * i for i in range(batch)])
    want = llm.generate(prompts, params, use_tqdm=False)
    runner.decode_graphs = _graphs(runner, llm)
    head_calls = []  # rows of each logits computation outside the graphs
    head = runner.compute_logits
    monkeypatch.setattr(runner, "compute_logits", lambda hidden: (head_calls.append(hidden.shape[0]), head(hidden))[1])
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        # Every step after the prompts' is a decode-only step of `batch` rows.
        assert runner.decode_graphs.num_replays == params.max_tokens - 1
        # The graphs computed the decode steps' logits: only the prompts' step needed the head.
        assert head_calls == [batch]
    finally:
        runner.decode_graphs = None
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for g_step, w_step in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert g_step.token_logprob == pytest.approx(w_step.token_logprob, abs=1e-4)


class OracleProposer(DraftProposer):
    """Drafts the known continuation of each prompt: every draft holds."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]):
        self.continuations = continuations

    def propose(self, requests, emitted_token_ids):
        drafts = []
        for req, emitted in zip(requests, emitted_token_ids):
            start = len(req.output_token_ids) + len(emitted)
            drafts.append(self.continuations[tuple(req.prompt_token_ids)][start:start + req.num_drafts_to_propose])
        return drafts


def test_verification_steps_replay_the_decode_graphs(tiny_model_factory, llm):
    """A request verifying k drafts is k + 1 decode rows: its steps replay a bucket's graph
    (two requests x (1 + 3) rows: the bucket of 8), and the tokens are those without
    speculation."""
    spec = dict(method="ngram", num_speculative_tokens=3, disable_by_batch_size=None, min_acceptance_rate=0.0)
    spec_llm = LLM(str(tiny_model_factory("tiny-llama", "llama")), dtype="float32", enforce_eager=True,
                   max_num_seqs=MAX_NUM_SEQS, kv_cache_memory="64MiB", speculative_config=spec)
    try:
        runner = _runner(spec_llm)
        params = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)
        prompts = _prompts([9, 26])
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runner.proposer = OracleProposer({tuple(p["prompt_token_ids"]): w for p, w in zip(prompts, want)})
        runner.decode_graphs = _graphs(runner, spec_llm)
        run = runner.decode_graphs.run
        replayed_rows = []
        runner.decode_graphs.run = lambda ids, positions, meta: (replayed_rows.append(ids.shape[0]),
                                                                 run(ids, positions, meta))[1]
        got = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert spec_llm.engine.stats()["spec_acceptance_rate"] == 1.0
        # After the prompts' step, every step verifies three drafts a request: 8 rows.
        assert replayed_rows == [8] * 4
    finally:
        spec_llm.engine.shutdown()


def _decode_meta(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> AttentionMetadata:
    positions = (seq_lens - 1).tolist()
    slot_mapping = torch.tensor([int(block_tables[i, p // block_size]) * block_size + p % block_size
                                 for i, p in enumerate(positions)])
    return AttentionMetadata(slot_mapping=slot_mapping, num_decode_tokens=len(positions),
                             decode_block_tables=block_tables, decode_seq_lens=seq_lens,
                             max_decode_seq_len=int(seq_lens.max()), prefill_block_tables=None,
                             prefill_query_start_loc=None, prefill_seq_lens=None, max_prefill_query_len=0,
                             max_prefill_seq_len=0)


def test_padding_rows_write_no_kv(llm):
    runner = _runner(llm)
    graphs = _graphs(runner, llm)
    bs = runner.block_size
    saved = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    try:
        # Four rows fill the bucket of 4; then three rows of it run with new tokens, and the
        # fourth row's slot, left from the first step, must come out as that step left it.
        block_tables = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]], dtype=torch.int32)
        seq_lens = torch.tensor([bs + 1, 3, 2 * bs, 5], dtype=torch.int32)
        meta = _decode_meta(block_tables, seq_lens, bs)
        graphs.run(torch.tensor([5, 6, 7, 8]), (seq_lens - 1).long(), meta)
        before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        meta = _decode_meta(block_tables[:3], seq_lens[:3], bs)
        hidden, logits = graphs.run(torch.tensor([9, 10, 11]), (seq_lens[:3] - 1).long(), meta)  # bucket 4
        assert hidden.shape == (3, llm.engine.model_config.hidden_size) and torch.isfinite(hidden).all()
        torch.testing.assert_close(logits, runner.compute_logits(hidden))  # each row's own
        written = set(meta.slot_mapping.tolist())
        for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
            changed = ((k0 != k1).flatten(2).any(-1) | (v0 != v1).flatten(2).any(-1)).flatten()  # [num_slots]
            assert set(changed.nonzero().flatten().tolist()) == written
    finally:
        for (k0, v0), (k1, v1) in zip(saved, runner.kv_caches):  # the pool as it was, for later tests
            k1.copy_(k0)
            v1.copy_(v0)


def test_steps_a_graph_does_not_serve(llm):
    graphs = _graphs(_runner(llm), llm)
    decode = AttentionMetadata(slot_mapping=torch.zeros(2, dtype=torch.int64), num_decode_tokens=2,
                               decode_block_tables=torch.zeros((2, 1), dtype=torch.int32),
                               decode_seq_lens=torch.ones(2, dtype=torch.int32), max_decode_seq_len=1,
                               prefill_block_tables=None, prefill_query_start_loc=None, prefill_seq_lens=None,
                               max_prefill_query_len=0, max_prefill_seq_len=0)
    assert graphs.serves(2, decode)
    assert not graphs.serves(3, decode)  # a prefill chunk beside the decodes
    too_many = AttentionMetadata(**{**decode.__dict__, "num_decode_tokens": MAX_NUM_SEQS + 1})
    assert not graphs.serves(MAX_NUM_SEQS + 1, too_many)
    hooked = AttentionMetadata(**{**decode.__dict__, "kv_layer_hook": lambda layer_idx: None})
    assert not graphs.serves(2, hooked)
    too_wide = AttentionMetadata(**{**decode.__dict__,
                                    "decode_block_tables": torch.zeros((2, 10_000), dtype=torch.int32)})
    assert not graphs.serves(2, too_wide)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_cuda_graphs_match_the_compiled_forward(tiny_model_factory, monkeypatch, kv_cache_dtype):
    """With a pool of fp8 codes too (GPUs of compute capability 8.9 on): the graphs hold
    the codes' writes (torch's rounding, Triton's scatter) and the kernels' reads."""
    if kv_cache_dtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 KV needs compute capability 8.9 or later")
    monkeypatch.delenv("PDSERVE_ENFORCE_EAGER", raising=False)
    model_dir = str(tiny_model_factory("tiny-llama", "llama"))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = _prompts([5, 17, 30])
    options = dict(dtype="float32", device="cuda", max_num_seqs=MAX_NUM_SEQS, kv_cache_memory="256MiB",
                   kv_cache_dtype=kv_cache_dtype)
    with_graphs = LLM(model_dir, **options)
    try:
        assert _runner(with_graphs).decode_graphs is not None
        if kv_cache_dtype == "fp8":
            assert _runner(with_graphs).kv_caches[0][0].dtype == torch.float8_e4m3fn
        got = with_graphs.generate(prompts, params, use_tqdm=False)
        assert _runner(with_graphs).decode_graphs.num_replays >= params.max_tokens - 1
    finally:
        with_graphs.engine.shutdown()
    monkeypatch.setenv("PDSERVE_CUDA_GRAPHS", "0")
    without = LLM(model_dir, **options)
    try:
        assert _runner(without).decode_graphs is None
        want = without.generate(prompts, params, use_tqdm=False)
    finally:
        without.engine.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
