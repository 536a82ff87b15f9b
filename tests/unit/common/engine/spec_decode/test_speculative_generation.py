"""Speculative decoding end to end on tiny random models: the tokens are the same with
speculation on and off, for every proposer, greedy and seeded, alone and mixed with
plain decodes and prefill chunks in one step."""
from __future__ import annotations

import random

import pytest
import torch

from common.engine.llm import LLM
from common.engine.models.prepacked_linear import PrepackedLinear
from common.engine.outputs import ScheduledRequest
from common.engine.sampling_params import SamplingParams
from common.engine.spec_decode.proposer import DraftProposer
from kernels.cpu_decode import native_decode_available
from tests.support.native_loop import NO_PACKED_BF16, bf16_is_packed, with_native_loop

K = 3
NUM_PROMPTS = 20
ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=512, block_size=4, max_num_batched_tokens=256)


# A small vocabulary makes the random models' greedy outputs fall into loops, which
# n-gram lookups find: their drafts are then often right, as on copy-heavy text.
VOCAB_SIZE = 128


def make_prompts(seed: int = 0) -> list[list[int]]:
    """Token-id prompts, half with a repeated phrase."""
    rng = random.Random(seed)
    prompts = []
    for i in range(NUM_PROMPTS):
        body = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(3, 20))]
        prompts.append(body * 3 if i % 2 else body)
    return prompts


def generate(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=24, ignore_eos=True)


def spec(method: str = "ngram", **options) -> dict:
    return dict(method=method, num_speculative_tokens=K, disable_by_batch_size=None, min_acceptance_rate=0.0,
                **options)


class ReferenceProposer(DraftProposer):
    """Drafts from known outputs: the exact continuation (an oracle), or the next token
    id after it (an adversary whose every draft is wrong)."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], offset: int):
        self.references = references
        self.offset = offset

    def propose(self, requests: list[ScheduledRequest], emitted_token_ids: list[list[int]]) -> list[list[int]]:
        drafts = []
        for req, emitted in zip(requests, emitted_token_ids):
            reference = self.references[tuple(req.prompt_token_ids)]
            start = len(req.output_token_ids) + len(emitted)
            drafts.append([(t + self.offset) % VOCAB_SIZE
                           for t in reference[start:start + req.num_drafts_to_propose]])
        return drafts


@pytest.fixture(scope="module")
def target_dir(tiny_model_factory):
    return tiny_model_factory("spec-target", num_hidden_layers=4, vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="module")
def reference(target_dir):
    """Outputs without speculation: greedy, and seeded sampled."""
    llm = LLM(str(target_dir), **ENGINE)
    prompts = make_prompts()
    result = {"prompts": prompts, "greedy": generate(llm, prompts, greedy()),
              "seeded": generate(llm, prompts, [seeded(i) for i in range(NUM_PROMPTS)])}
    llm.engine.shutdown()
    return result


def spec_llm(target_dir, config: dict) -> LLM:
    return LLM(str(target_dir), speculative_config=config, **ENGINE)


def proposer_config(method: str, tiny_model_factory) -> dict:
    if method == "draft_model":
        return spec("draft_model", draft_model=str(tiny_model_factory("spec-draft", num_hidden_layers=1,
                                                                       hidden_size=32, intermediate_size=64,
                                                                       vocab_size=VOCAB_SIZE)))
    if method == "early_exit":
        return spec("early_exit", num_early_exit_layers=1)
    return spec("ngram")


@pytest.mark.parametrize("method", ["ngram", "early_exit", "draft_model", "oracle", "adversary"])
def test_greedy_outputs_are_unchanged_by_speculation(target_dir, tiny_model_factory, reference, method):
    prompts = reference["prompts"]
    llm = spec_llm(target_dir, proposer_config(method, tiny_model_factory))
    if method in ("oracle", "adversary"):
        references = {tuple(p): out for p, out in zip(prompts, reference["greedy"])}
        llm.engine.executor.runner.proposer = ReferenceProposer(references, 0 if method == "oracle" else 1)
    assert generate(llm, prompts, greedy()) == reference["greedy"]
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    if method in ("ngram", "early_exit"):
        assert stats["spec_num_accepted_tokens"] > 0  # the loops are found
    if method == "oracle":
        assert stats["spec_acceptance_rate"] == 1.0
    if method == "adversary":
        assert stats["spec_num_accepted_tokens"] == 0
    llm.engine.shutdown()


def test_bad_words_hold_on_verification_rows(target_dir, reference):
    """Each verification row sees the drafts before it as output, so a bad word that spans
    drafts is masked where it would be without speculation."""
    prompts = reference["prompts"]
    # ban, per prompt, a pair its greedy answer writes (the mask must take effect) and one token
    params = [greedy().clone(bad_words_token_ids=[out[4:6], [out[10]]]) for out in reference["greedy"]]
    plain = LLM(str(target_dir), **ENGINE)
    expected = generate(plain, prompts, params)
    plain.engine.shutdown()
    assert expected != reference["greedy"]
    for ids, p in zip(expected, params):
        pair, (single,) = p.bad_words_token_ids
        assert single not in ids and not any(ids[i:i + 2] == pair for i in range(len(ids)))
    llm = spec_llm(target_dir, spec("ngram"))
    assert generate(llm, prompts, params) == expected
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    llm.engine.shutdown()


@pytest.mark.parametrize("method", ["ngram", "early_exit", "draft_model", "oracle"])
def test_seeded_sampling_is_unchanged_by_point_mass_speculation(target_dir, tiny_model_factory, reference, method):
    prompts = reference["prompts"]
    llm = spec_llm(target_dir, proposer_config(method, tiny_model_factory))
    if method == "oracle":
        references = {tuple(p): out for p, out in zip(prompts, reference["seeded"])}
        llm.engine.executor.runner.proposer = ReferenceProposer(references, 0)
    assert generate(llm, prompts, [seeded(i) for i in range(NUM_PROMPTS)]) == reference["seeded"]
    assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
    llm.engine.shutdown()


@pytest.mark.parametrize("method", ["ngram", "oracle"])
def test_the_split_attention_path_verifies_decode_rows_too(target_dir, reference, monkeypatch, method):
    """PDSERVE_CPU_ATTENTION=torch: each layer writes the step's K/V, then the decode rows
    (verification rows among them) and the prefill chunks attend in separate calls, as on
    CUDA; greedy and seeded tokens are still those without speculation."""
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "torch")
    prompts = reference["prompts"]
    llm = spec_llm(target_dir, spec("ngram"))
    if method == "oracle":
        references = {tuple(p): out for p, out in zip(prompts, reference["greedy"])}
        llm.engine.executor.runner.proposer = ReferenceProposer(references, 0)
    assert generate(llm, prompts, greedy()) == reference["greedy"]
    if method == "ngram":
        assert generate(llm, prompts, [seeded(i) for i in range(NUM_PROMPTS)]) == reference["seeded"]
    assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
    llm.engine.shutdown()


def test_a_draft_equal_to_the_target_is_always_accepted(target_dir, reference):
    # 1 + 4 (k + 1) tokens: the prefill samples one, then four verifications of k drafts.
    max_tokens = 1 + 4 * (K + 1)
    llm = spec_llm(target_dir, spec("draft_model", draft_model=str(target_dir)))
    prompts = reference["prompts"][:4]
    outputs = generate(llm, prompts, greedy(max_tokens))
    assert outputs == [out[:max_tokens] for out in reference["greedy"][:4]]
    stats = llm.engine.stats()
    assert stats["spec_acceptance_rate"] == 1.0
    assert stats["spec_mean_acceptance_length"] == K + 1
    assert stats["spec_num_drafts"] == 4 * len(prompts)
    llm.engine.shutdown()


@pytest.mark.parametrize("switch", ["1", "0"], ids=["packed", "switched-off"])
def test_a_draft_model_runs_on_packed_linears_as_the_target_does(target_dir, tiny_model_factory, reference,
                                                                 monkeypatch, switch):
    """The draft model runs eagerly in every mode, on the CPU's packed linears unless
    PDSERVE_PREPACK_LINEARS=0 turns them off for the target too."""
    monkeypatch.setenv("PDSERVE_PREPACK_LINEARS", switch)
    llm = spec_llm(target_dir, proposer_config("draft_model", tiny_model_factory))
    try:
        runner = llm.engine.executor.runner
        packed = switch == "1"
        for model in (runner.model, runner.proposer.model):
            linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, PrepackedLinear))]
            assert linears and all(isinstance(m, PrepackedLinear) == packed for m in linears)
            assert (getattr(model, "prepacked_head", None) is not None) == packed
        prompts = reference["prompts"][:6]
        outputs = generate(llm, prompts, greedy())
        if packed:  # the reference engine's linears are packed too
            assert outputs == reference["greedy"][:6]
        assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    finally:
        llm.engine.shutdown()


def spec_stats(llm: LLM) -> dict:
    return {name: value for name, value in llm.engine.stats().items() if name.startswith("spec_")}


@pytest.mark.parametrize("method, parallel", [("ngram", dict(tensor_parallel_size=2)),
                                              ("draft_model", dict(tensor_parallel_size=2)),
                                              ("early_exit", dict(tensor_parallel_size=2)),
                                              ("target_as_draft", dict(pipeline_parallel_size=2))],
                         ids=["ngram-tp2", "draft-model-tp2", "early-exit-tp2", "target-as-draft-pp2"])
def test_speculation_over_ranks_gives_one_process_greedy_outputs(target_dir, tiny_model_factory, reference, method,
                                                                 parallel):
    """Worker processes (mp): every rank verifies the drafts, the rank that samples drafts
    (a draft model whole on it), and every TP rank runs an early exit's draft passes through
    its share of the first layers, from the tokens the output rank sampled. n-grams then
    draft and are accepted as in one process; the target as its own draft on the last of
    two stages agrees with every verification."""
    config = (spec("draft_model", draft_model=str(target_dir)) if method == "target_as_draft"
              else proposer_config(method, tiny_model_factory))
    llm = LLM(str(target_dir), speculative_config=config, distributed_executor_backend="mp", **parallel, **ENGINE)
    try:
        assert generate(llm, reference["prompts"], greedy()) == reference["greedy"]
        stats = spec_stats(llm)
    finally:
        llm.engine.shutdown()
    assert stats["spec_num_draft_tokens"] > 0
    if method == "early_exit":
        assert stats["spec_num_accepted_tokens"] > 0  # the loops are found
    if method == "ngram":
        one_process = spec_llm(target_dir, config)
        generate(one_process, reference["prompts"], greedy())
        assert stats == spec_stats(one_process)
        one_process.engine.shutdown()
    if method == "target_as_draft":
        assert stats["spec_acceptance_rate"] == 1.0


def test_mixed_steps_give_each_request_its_own_outputs(target_dir, reference):
    """Speculating rows, plain decode rows (constrained by max_tokens to no drafts) and
    prefill chunks in the same steps: a small token budget chunks the long prompts."""
    prompts = reference["prompts"]
    llm = LLM(str(target_dir), speculative_config=spec("ngram"),
              **(ENGINE | dict(max_num_batched_tokens=24)))
    params = [greedy(1 if i % 5 == 0 else 24) for i in range(NUM_PROMPTS)]
    outputs = generate(llm, prompts, params)
    assert outputs == [ref[:p.max_tokens] for ref, p in zip(reference["greedy"], params)]
    llm.engine.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_over_a_pool_of_fp8_codes_greedy_outputs_are_unchanged_by_speculation(target_dir, tiny_model_factory,
                                                                               method):
    """kv_cache_dtype fp8: the verification steps and a draft model's own KV read and write
    codes as the plain decode steps do, so speculation still changes no token."""
    prompts = make_prompts()
    plain = LLM(str(target_dir), kv_cache_dtype="fp8", **ENGINE)
    want = generate(plain, prompts, greedy())
    plain.engine.shutdown()
    llm = LLM(str(target_dir), speculative_config=proposer_config(method, tiny_model_factory), kv_cache_dtype="fp8",
              **ENGINE)
    runner = llm.engine.executor.runner
    assert runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    if method == "draft_model":
        assert runner.proposer.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert generate(llm, prompts, greedy()) == want
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    llm.engine.shutdown()


@pytest.mark.skipif(not native_decode_available(), reason="no native GEMV or attention here")
def test_verification_steps_run_in_the_native_loop(target_dir):
    """On the CPU a request verifying k drafts is k + 1 decode rows, so its steps run in the
    native loop as plain decode steps do (not through the prefill kernels), and the tokens
    stay those of plain decoding. fp32: in bf16 a row's roundings may depend on the rows
    beside it (a long context split across threads, the GEMM chosen by row count), so near
    ties can fall either way (docs/benchmarks.md, "Speculative decoding")."""
    prompts = make_prompts()
    engine = ENGINE
    plain = LLM(str(target_dir), **engine)
    assert with_native_loop(plain) is not None
    want = generate(plain, prompts, greedy(40))
    plain.engine.shutdown()
    llm = LLM(str(target_dir), speculative_config=spec("ngram"), **engine)
    runner = llm.engine.executor.runner
    loop = with_native_loop(llm)
    assert loop is not None
    run_model, forward = runner._run_model, runner._forward
    num_verification_steps = [0, 0]  # all, in the loop

    def recording_run_model(scheduler_output):
        verifies = any(r.spec_token_ids for r in scheduler_output.scheduled)
        prefills = any(len(r.token_ids) > 1 + len(r.spec_token_ids) for r in scheduler_output.scheduled)
        steps_before = loop.num_steps
        output = run_model(scheduler_output)
        if verifies and not prefills:
            num_verification_steps[0] += 1
            num_verification_steps[1] += loop.num_steps - steps_before
        return output

    def forward_of_prefills(input_ids, positions, meta, received, keep_rows):
        assert meta.num_decode_tokens < input_ids.shape[0], "a decode-only step left the loop"
        return forward(input_ids, positions, meta, received, keep_rows)

    runner._run_model, runner._forward = recording_run_model, forward_of_prefills
    assert generate(llm, prompts, greedy(40)) == want
    assert num_verification_steps[0] >= 5 and num_verification_steps[1] == num_verification_steps[0]
    assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
    llm.engine.shutdown()


@pytest.mark.skipif(not native_decode_available(), reason="no native GEMV or attention here")
@pytest.mark.skipif(not bf16_is_packed(), reason=NO_PACKED_BF16)
def test_the_loop_samples_verification_rows_as_the_sampler_does(target_dir):
    """A bf16 model (its steps end in the loop's head): a verification step's k + 1 rows of a
    request each take their token in the loop with the state they would have without
    speculation (expand_verification_rows), greedy, or drawn at a temperature with
    penalties, logprobs and stop tokens held back by min_tokens: the tokens and logprobs
    the sampler takes from the loop's hidden states. Each run from an empty prefix cache,
    so both see the same steps."""
    prompts = make_prompts()
    llm = LLM(str(target_dir), speculative_config=spec("ngram"), **(ENGINE | dict(dtype="bfloat16")))
    loop = with_native_loop(llm)
    assert loop is not None
    max_head_tokens = loop.max_head_tokens
    if max_head_tokens == 0:
        llm.engine.shutdown()
        pytest.skip("bf16 panels run on AMX tiles here, outside the loop's regions: no step ends in its head")
    requests = [{"prompt_token_ids": p} for p in prompts]
    # Penalties light enough that the n-gram drafts still hold at times.
    drawn = [SamplingParams(temperature=0.5, seed=7 + i, max_tokens=24, ignore_eos=True, logprobs=2,
                            repetition_penalty=1.05, frequency_penalty=0.05, min_tokens=6) for i in range(NUM_PROMPTS)]
    for params in (greedy(), drawn):
        steps_before, accepted_before = loop.num_token_steps, llm.engine.stats()["spec_num_accepted_tokens"]
        llm.reset_prefix_cache()
        got = [o.outputs[0] for o in llm.generate(requests, params, use_tqdm=False)]
        assert loop.num_token_steps > steps_before
        assert llm.engine.stats()["spec_num_accepted_tokens"] > accepted_before
        loop.max_head_tokens = 0  # the loop's hidden states, then compute_logits and the sampler
        llm.reset_prefix_cache()
        want = [o.outputs[0] for o in llm.generate(requests, params, use_tqdm=False)]
        loop.max_head_tokens = max_head_tokens
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.logprobs for o in got] == [o.logprobs for o in want]
    llm.engine.shutdown()


@pytest.mark.skipif(not native_decode_available(), reason="no native GEMV or attention here")
@pytest.mark.parametrize("method", ["early_exit", "draft_model"])
def test_draft_passes_run_in_the_proposers_own_native_loop(target_dir, tiny_model_factory, method):
    """A proposer that runs model layers drafts through a native loop of its own (the
    target's first layers, or the draft model's) where the engine decodes natively: its
    decode passes leave the eager model, and the tokens stay those of plain decoding."""
    prompts = make_prompts()
    engine = ENGINE
    plain = LLM(str(target_dir), **engine)
    assert with_native_loop(plain) is not None
    want = generate(plain, prompts, greedy())
    plain.engine.shutdown()
    llm = LLM(str(target_dir), speculative_config=proposer_config(method, tiny_model_factory), **engine)
    assert with_native_loop(llm) is not None
    proposer = llm.engine.executor.runner.proposer
    draft_loop = proposer.loop
    assert draft_loop is not None and len(draft_loop.k_caches) == 1  # one exit layer, or the draft's one layer
    assert generate(llm, prompts, greedy()) == want
    stats = llm.engine.stats()
    # Every draft token came from a pass of the loop (draft_greedily: one pass per position).
    assert draft_loop.num_steps >= K and stats["spec_num_draft_tokens"] > 0
    assert stats["spec_num_accepted_tokens"] > 0
    llm.engine.shutdown()
