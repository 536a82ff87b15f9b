"""The native decode loop: the same tokens and logprobs as the model's own forward pass, for
every family it serves, in fp32, bf16 and over the GGUF's Q4_1 blocks; the others keep
the compiled model; bad calls raise and write nothing.

The engines here run eagerly (the suite's default) and take the loop by hand: what it
reads is the packed linears' decode weights (prepack_linears), not a compiled graph, and
compiling each family would cost the suite minutes. test_compilation checks that a
compiled engine builds the loop itself.
"""
from __future__ import annotations

import gc
import re
import sys

import pytest
import safetensors.torch
import torch

from common.engine.forward_context import forward_context
from common.engine.llm import LLM
from common.engine.models.prepacked_linear import prepack_linears
from common.engine.native_decode import NativeDecodeLoop, _model_tensors, decode_weight
from common.engine.outputs import ScheduledRequest
from common.engine.sampler import Sampler
from common.engine.sampling_params import SamplingParams
from kernels.cpu_decode import (DECODE_MAX_TOKENS, LINEAR_DENSE, LINEAR_PANELS, LINEAR_Q4_1, LINEAR_Q8_0,
                                TokenLogprobs, TokenHistory, TokenSampling, decode_layers, decode_model_max_head_tokens,
                                decode_model_max_tokens, decode_tokens,
                                native_decode_available, register_decode_model, release_decode_model)
from kernels.cpu_linear import (f32_panel_gemm_max_rows, panel_gemm_amx_tiles, panel_gemm_available,
                                panel_gemm_max_rows, q8_0_max_rows)
from kernels.cpu_sampling import argmax_rows
from tests.support.native_loop import NO_PACKED_BF16, bf16_is_packed, packed_dtype, with_native_loop
from tests.unit.common.engine.models.family_parity import parity_prompts, save_tiny_model

pytestmark = pytest.mark.skipif(not native_decode_available(), reason="no native GEMV or attention here")

# fp32: the loop and the model differ in summation order only.
FP32_LOGPROB_ATOL = 1e-4
# bf16: the loop's largest logit error against fp32 may exceed the model's own by this
# factor at most (measured on the bundled model, AVX-512 build: 0.30 against 0.39).
BF16_ERROR_RATIO = 1.25
# bf16, the loop's hidden state against the model's, per sequence (measured <= 1.4%).
BF16_HIDDEN_RELATIVE_ERROR = 0.02
# Quantized projections: the loop's hidden state may differ from the model's by this share
# of its norm (the GEMVs' x codes, see the test).
QUANTIZED_RELATIVE_ERROR = 0.03


def _family_dir(tmp_path_factory, bundled_model_dir, family: str):
    import transformers
    out = tmp_path_factory.mktemp(family)
    if family == "llama":
        return save_tiny_model(out, transformers.LlamaConfig, transformers.LlamaForCausalLM, bundled_model_dir)
    if family == "qwen2":  # biases on q/k/v, made nonzero (transformers initialises them to 0)
        model_dir = save_tiny_model(out, transformers.Qwen2Config, transformers.Qwen2ForCausalLM, bundled_model_dir)
        path = model_dir / "model.safetensors"
        tensors = safetensors.torch.load_file(path)
        generator = torch.Generator().manual_seed(0)
        for name, tensor in tensors.items():
            if name.endswith("proj.bias"):
                tensors[name] = torch.randn(tensor.shape, generator=generator)
        safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
        return model_dir
    if family == "mistral":  # an 8-position window, shorter than the sequences
        return save_tiny_model(out, transformers.MistralConfig, transformers.MistralForCausalLM, bundled_model_dir,
                               sliding_window=8, head_dim=16)
    if family == "phi4-mini":  # half of each head rotated
        return save_tiny_model(out, transformers.Phi3Config, transformers.Phi3ForCausalLM, bundled_model_dir,
                               pad_token_id=0, partial_rotary_factor=0.5, tie_word_embeddings=True)
    if family == "qwen3":  # q/k norms
        return save_tiny_model(out, transformers.Qwen3Config, transformers.Qwen3ForCausalLM, bundled_model_dir,
                               head_dim=16)
    raise AssertionError(family)


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int]):
    """Greedy, with logprobs; the prompts' lengths of output differ, so a batch's decode
    steps shrink through every size from len(prompts) down."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in max_tokens]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def _assert_same(got, want, atol: float) -> None:
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        g_logprobs = torch.tensor([step.token_logprob for step in g.outputs[0].logprobs])
        w_logprobs = torch.tensor([step.token_logprob for step in w.outputs[0].logprobs])
        torch.testing.assert_close(g_logprobs, w_logprobs, atol=atol, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi4-mini"])
def test_the_loop_matches_the_model_for_each_family(tmp_path_factory, bundled_model_dir, family):
    model_dir = _family_dir(tmp_path_factory, bundled_model_dir, family)
    options = dict(dtype="float32", num_kv_blocks=160, block_size=4)
    gc.collect()
    native = LLM(str(model_dir), **options)
    loop = with_native_loop(native)
    assert loop is not None
    eager = LLM(str(model_dir), **options)
    prompts = parity_prompts()  # lengths 5, 17, 70, 1
    # Past the GEMVs' rows the loop's linears are the prepacked op's (oneDNN in fp32).
    many = [prompts[i % 4][: 3 + i] for i in range(20)]
    # One sequence alone; six decoding together (prepacked linears) until four remain (GEMVs);
    # twenty shrinking to one.
    for batch, max_tokens in (([prompts[1]], [12]), ([*prompts, prompts[0][:3], prompts[2][:9]], [3, 4, 12, 14, 5, 10]),
                              (many, [2 + i % 7 for i in range(20)])):
        steps_before = loop.num_steps
        _assert_same(_generate(native, batch, max_tokens), _generate(eager, batch, max_tokens), FP32_LOGPROB_ATOL)
        assert loop.num_steps > steps_before
    native.engine.shutdown()
    eager.engine.shutdown()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_the_loop_over_fp8_caches_matches_the_model(tiny_llama_dir, kv_cache_dtype):
    """The loop writes and reads the KV codes as the model's attention does: the same tokens
    and logprobs from a pool of codes. In fp32, where the two differ in summation order only
    (in bf16 a K or V rounded differently by the linears may take another code; the kernels'
    bf16 reads of codes are tested in tests/unit/kernels/test_fp8_kv_cache.py)."""
    options = dict(dtype="float32", num_kv_blocks=160, block_size=16, kv_cache_dtype=kv_cache_dtype)
    native = LLM(str(tiny_llama_dir), **options)
    loop = with_native_loop(native)
    assert loop is not None
    eager = LLM(str(tiny_llama_dir), **options)
    codes = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    for llm in (native, eager):
        assert all(k.dtype == v.dtype == codes for k, v in llm.engine.executor.runner.kv_caches)
    prompts = parity_prompts()
    batch, max_tokens = [*prompts, prompts[2][:40]], [12, 3, 9, 14, 6]
    got, want = _generate(native, batch, max_tokens), _generate(eager, batch, max_tokens)
    assert loop.num_steps > 0
    _assert_same(got, want, FP32_LOGPROB_ATOL)
    native.engine.shutdown()
    eager.engine.shutdown()


def _decode_step(llm: LLM, prompts: list[list[int]], loop: NativeDecodeLoop | None,
                 num_layers: int | None = None, greedy: bool = False, num_steps: int = 1,
                 stop_token_ids: list[int] | None = None, sampling: TokenSampling | None = None,
                 logprobs: TokenLogprobs | None = None, history: TokenHistory | None = None) -> torch.Tensor:
    """Prefill the prompts (each in its own blocks) through the model, then one decode step
    through the loop (None: the model, its first num_layers layers): the normed hidden
    states [len(prompts), hidden_size]; greedy: the loop's next tokens [len(prompts),
    num_steps] (run_tokens, num_steps steps back to back, drawn as sampling says after the
    history, the logprobs written to logprobs)."""
    runner = llm.engine.executor.runner
    params = SamplingParams(temperature=0.0)
    block_size = llm.engine.config.cache.block_size
    # each sequence's own blocks
    num_blocks = [max(4, -(-(len(p) + num_steps) // block_size)) for p in prompts]
    firsts = [sum(num_blocks[:i]) for i in range(len(prompts))]
    tables = [list(range(first, first + n)) for first, n in zip(firsts, num_blocks)]
    prefill = [ScheduledRequest(f"r{i}", p, 0, t, True, params) for i, (p, t) in enumerate(zip(prompts, tables))]
    decode = [ScheduledRequest(f"r{i}", [p[-1]], len(p), t, True, params)
              for i, (p, t) in enumerate(zip(prompts, tables))]
    for k_cache, v_cache in runner.kv_caches:  # nothing left from an earlier step at the decode's slots
        k_cache.zero_()
        v_cache.zero_()
    # The decode step reads the KV of no layer past its own: the prefill stops there too.
    prefill_layers = len(loop.k_caches) if loop is not None else num_layers
    with torch.inference_mode():
        ids, positions, meta, _, _ = runner.prepare_inputs(prefill)
        with forward_context(meta):
            runner.model(ids, positions, runner.kv_caches, meta, num_layers=prefill_layers)
        ids, positions, meta, _, _ = runner.prepare_inputs(decode)
        if greedy:
            assert loop.serves_tokens(ids.shape[0], meta)
            return loop.run_tokens(ids, positions, meta, num_steps, stop_token_ids, sampling, logprobs=logprobs,
                                   history=history)
        if loop is not None:
            assert loop.serves(ids.shape[0], meta)
            return loop.run(ids, positions, meta)
        with forward_context(meta):
            return runner.model(ids, positions, runner.kv_caches, meta, num_layers=num_layers)


@torch.inference_mode()
def _logits(llm: LLM, hidden: torch.Tensor) -> torch.Tensor:
    return llm.engine.executor.runner.compute_logits(hidden)


def _prompts(num_prompts: int) -> list[list[int]]:
    return [[(31 * i + 7 * n) % 40000 + 100 for i in range(n)] for n in (5, 17, 40, 23, 9, 61, 33)[:num_prompts]]


PROMPTS = _prompts(3)

needs_packed_bf16 = pytest.mark.skipif(not bf16_is_packed(), reason=NO_PACKED_BF16)


def in_bf16(quantization: str | None):
    """A (quantization, dtype) case in bf16, for a test whose model must be packed."""
    return pytest.param(quantization, "bfloat16", marks=needs_packed_bf16)


@needs_packed_bf16
def test_in_bf16_the_loop_is_as_close_to_fp32_as_the_model():
    """The bundled model: a decode step of three sequences in bf16 through the loop is no
    further from the fp32 model's logits than the bf16 model's own forward pass is (each
    rounds differently: the loop once per fused step, the model after each op)."""
    reference = LLM(dtype="float32", kv_cache_memory="32MiB")
    want = _logits(reference, _decode_step(reference, PROMPTS, None))
    reference.engine.shutdown()
    llm = LLM(dtype="bfloat16", kv_cache_memory="32MiB")
    loop = with_native_loop(llm)
    # With AVX512-BF16 every projection's decode steps read its column panels (a bf16
    # weight's only decode copy), elsewhere the row-major rows.
    kinds = _model_tensors(llm.engine.executor.runner.model, None)["kinds"]
    assert set(kinds) == {LINEAR_PANELS if panel_gemm_available() else LINEAR_DENSE}
    loop_error = (_logits(llm, _decode_step(llm, PROMPTS, loop)) - want).abs().max().item()
    model_error = (_logits(llm, _decode_step(llm, PROMPTS, None)) - want).abs().max().item()
    assert loop_error <= BF16_ERROR_RATIO * model_error, (loop_error, model_error)
    llm.engine.shutdown()


# Seven and twenty sequences take panel_gemm (bf16 with AVX512-BF16; twenty take oneDNN on
# an AMX CPU whose tiles panel_gemm may not use, 8 rows at most) through the prepacked op; past panel_gemm_max_rows() it
# calls oneDNN, the route fp32 steps of more than DECODE_MAX_TOKENS take as well
# (test_the_loop_matches_the_model_for_each_family, twenty sequences).
@needs_packed_bf16
@pytest.mark.parametrize("num_seqs", [DECODE_MAX_TOKENS + 3, 20])
def test_in_bf16_larger_steps_stay_with_the_model(num_seqs):
    """Past the GEMVs' rows, in bf16: each sequence's hidden state from the loop is within
    BF16_HIDDEN_RELATIVE_ERROR of the model's own forward pass, as at three rows (the two
    round apart: 0.5-1.4% of each row's norm measured at 4, 5, 7 and 17 sequences; a row
    or a weight read wrong is of the order of the state itself). Against fp32 the largest
    logit error of either is a matter of which row has it: from one batch to another the
    loop's share of it moves between 0.7x and 1.8x per row."""
    distinct = _prompts(7)
    prompts = [[t + 3 * i for t in distinct[i % 7]] for i in range(num_seqs)]
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB")
    loop = with_native_loop(llm)
    steps_before = loop.num_steps
    got = _decode_step(llm, prompts, loop).float()
    assert loop.num_steps == steps_before + 1
    want = _decode_step(llm, prompts, None).float()
    relative = (got - want).norm(dim=1) / want.norm(dim=1)  # [num_seqs]
    assert relative.max().item() < BF16_HIDDEN_RELATIVE_ERROR, relative
    llm.engine.shutdown()


@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_the_loop_over_quantized_blocks_computes_what_the_model_does(quantization):
    """The bundled model's projections as the GGUF's Q4_1 blocks, or int8 codes as Q8_0
    blocks, fp32 activations: the loop reads each kind as the model does. The GEMVs quantize
    x to int8 per 32 values, so where the loop's and the model's x differ in the last bit
    (their pointwise steps round apart) a value on a rounding boundary takes the other code,
    and the difference grows through the layers to ~1% of the hidden state and stays there:
    over these 6 layers 5e-7 (gguf, no code moved) and 0.9% (int8: one of row 0's SiLU
    outputs in layer 0 lies 1e-4 of a step from a boundary) of its norm, measured; a kind
    read wrong would be of the order of the state itself."""
    llm = LLM(dtype="float32", kv_cache_memory="32MiB", quantization=quantization)
    runner = llm.engine.executor.runner
    prepack_linears(runner.model)
    expected_kind = LINEAR_Q4_1 if quantization == "gguf" else LINEAR_Q8_0
    assert decode_weight(runner.model.layers[0].mlp.down_proj)[1] == expected_kind
    num_layers = 6
    loop = NativeDecodeLoop(runner.model, runner.kv_caches, num_layers=num_layers)
    assert len(loop.k_caches) == num_layers
    got = _decode_step(llm, PROMPTS, loop)
    want = _decode_step(llm, PROMPTS, None, num_layers=num_layers)
    assert ((got - want).norm() / want.norm()).item() < QUANTIZED_RELATIVE_ERROR
    # GGUF blocks' GEMVs take any number of rows: the loop serves steps of any size, and a
    # step of seven sequences gives each the hidden state it gets in steps of four and three
    # (the GEMV's rows, the attention's sequences and the norms' rows are independent).
    assert loop.max_num_tokens == decode_model_max_tokens(loop.model_id) == sys.maxsize
    prompts = _prompts(DECODE_MAX_TOKENS + 3)
    together = _decode_step(llm, prompts, loop)
    apart = torch.cat([_decode_step(llm, prompts[:DECODE_MAX_TOKENS], loop),
                       _decode_step(llm, prompts[DECODE_MAX_TOKENS:], loop)])
    assert torch.equal(together, apart)
    llm.engine.shutdown()


@pytest.mark.parametrize("quantization, dtype", [("gguf", "bfloat16"), ("int8", "float32"), (None, "bfloat16"),
                                                 (None, "float32")])
def test_one_region_a_step_gives_the_same_bits(quantization, dtype):
    """A model of GGUF blocks, or of column panels (bf16 ones where panel_gemm runs on vector
    units; fp32 ones in their tiles, each thread's rows whole tiles), runs
    each step in one parallel region (decode_layers.cpp, run_layers_in_regions), its
    threads meeting at barriers, the attention's work shared out by the attention
    library's team calls: each sequence's hidden state is bit for bit the one a fork and
    join per projection and attention gives, on one thread and on several (each projection's
    groups or panels and each token's rows split between them),
    at few rows (pointwise work on the first thread) and from 16 (split; panels: in the
    region as far as the prepacked op takes them for, past 4 rows), and where a lone
    sequence's attention is split over its keys."""
    if quantization is None and dtype == "bfloat16" and not (panel_gemm_available() and not panel_gemm_amx_tiles()):
        pytest.skip("bf16 panels on vector units only (AVX512-BF16 without AMX's tiles)")
    llm = LLM(dtype=dtype, kv_cache_memory="128MiB", quantization=quantization)
    runner = llm.engine.executor.runner
    prepack_linears(runner.model)
    num_layers = 4
    in_regions = NativeDecodeLoop(runner.model, runner.kv_caches, num_layers=num_layers)
    forked = NativeDecodeLoop(runner.model, runner.kv_caches, num_layers=num_layers, in_regions=False)
    assert in_regions.in_regions and not forked.in_regions
    assert in_regions.max_region_tokens >= 26  # the largest step below runs in the region too
    distinct = _prompts(7)
    threads_before = torch.get_num_threads()
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            # 300 keys: the lone sequence's attention split over its keys, the parts merged;
            # 13 and 26 rows: fp32 tiles of 12 rows with one joined (AVX-512) or a short last tile
            for num_seqs, long in ((1, False), (3, False), (13, False), (18, False), (26, False), (1, True)):
                prompts = ([[(13 * i) % 40000 + 100 for i in range(300)]] if long
                           else [[t + 5 * i for t in distinct[i % 7]] for i in range(num_seqs)])
                got = _decode_step(llm, prompts, in_regions)
                want = _decode_step(llm, prompts, forked)
                assert torch.equal(got, want), (num_threads, num_seqs, long)
    finally:
        torch.set_num_threads(threads_before)
    llm.engine.shutdown()


def _four_layer_loop(quantization: str | None, dtype: str):
    """An engine of the bundled model (its linears prepacked) and a native loop over its first
    four layers: (llm, runner, loop). Dense bf16 (quantization None) needs panels on vector
    units, else the test skips."""
    if quantization is None and dtype == "bfloat16" and not (panel_gemm_available() and not panel_gemm_amx_tiles()):
        pytest.skip("bf16 panels on vector units only (AVX512-BF16 without AMX's tiles)")
    llm = LLM(dtype=dtype, kv_cache_memory="64MiB", quantization=quantization)
    runner = llm.engine.executor.runner
    prepack_linears(runner.model)
    return llm, runner, NativeDecodeLoop(runner.model, runner.kv_caches, num_layers=4)


@pytest.mark.parametrize("quantization, dtype", [in_bf16("gguf"), ("gguf", "float32"), in_bf16("int8"),
                                                 in_bf16(None), (None, "float32")])
def test_greedy_steps_end_in_the_region_with_the_heads_tokens(quantization, dtype):
    """Where every row samples greedily, a model whose steps run in one region takes the
    token ids in and the next tokens out of it (run_tokens: the embedding, the layers, the
    packed head's GEMV and each thread's part of the argmax): each row's token is the argmax
    of compute_argmax_logits over run()'s hidden state, on one thread and on several (the
    head's columns and the argmax split between them), as far as the head's own op takes
    the region's GEMV (Q8_0 blocks: q8_0_max_rows; bf16 panels: panel_gemm_max_rows, fp32
    ones f32_panel_gemm_max_rows; up to 18 rows here), and where a lone sequence's attention is
    split. The same head with its rows rotated by half the vocabulary moves each token there:
    the winner then lies in a later thread's columns (the bundled model's likely tokens have low
    ids)."""
    llm, runner, loop = _four_layer_loop(quantization, dtype)
    tensors = _model_tensors(runner.model, 4)
    panels = tensors["head_kind"] == LINEAR_PANELS
    f32_panels = panels and tensors["head"].dtype == torch.float32
    assert panels or tensors["head_kind"] == LINEAR_Q8_0
    if panels and not f32_panels and panel_gemm_amx_tiles():  # the int8 model's dense head, on an AMX CPU
        assert loop.in_regions and loop.max_head_tokens == 0
        llm.engine.shutdown()
        pytest.skip("the head's bf16 panels run on AMX tiles, outside the loop's regions: no step ends there")
    # As far as prepacked_linear takes the head's panels or blocks, and the layers' region goes.
    op_rows = f32_panel_gemm_max_rows() if f32_panels else panel_gemm_max_rows() if panels else q8_0_max_rows()
    head_rows = min(loop.max_region_tokens, max(DECODE_MAX_TOKENS, op_rows))
    assert loop.in_regions and loop.max_head_tokens == head_rows
    most_rows = min(18, head_rows)
    vocab_size = tensors["vocab_size"]
    # Whole row groups (16 rows) or panels (32 rows; fp32: 16) rotate along the first dimension.
    rows_per_index = 16 if f32_panels else 32 if panels else 1
    rotated = NativeDecodeLoop(runner.model, runner.kv_caches, num_layers=4)
    release_decode_model(rotated.model_id)
    rotated.model_id = register_decode_model(**{**tensors, "head": torch.roll(
        tensors["head"], vocab_size // 2 // rows_per_index, dims=0)})
    distinct = _prompts(7)
    threads_before = torch.get_num_threads()
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            for num_seqs, long in ((1, False), (3, False), (most_rows, False), (1, True)):
                prompts = ([[(13 * i) % 40000 + 100 for i in range(300)]] if long
                           else [[t + 5 * i for t in distinct[i % 7]] for i in range(num_seqs)])
                got = _decode_step(llm, prompts, loop, greedy=True)[:, 0]
                with torch.inference_mode():
                    want = argmax_rows(runner.model.compute_argmax_logits(_decode_step(llm, prompts, loop)))
                assert got.tolist() == want.tolist(), (num_threads, num_seqs, long)
                got = _decode_step(llm, prompts, rotated, greedy=True)[:, 0]
                assert got.tolist() == ((want + vocab_size // 2) % vocab_size).tolist(), (num_threads, num_seqs)
    finally:
        torch.set_num_threads(threads_before)
        release_decode_model(rotated.model_id)
    with torch.inference_mode():
        _, _, meta, _, _ = runner.prepare_inputs(
            [ScheduledRequest(f"r{i}", [7], 3, [i], True, SamplingParams()) for i in range(DECODE_MAX_TOKENS + 1)])
    assert loop.serves(DECODE_MAX_TOKENS + 1, meta)
    assert loop.serves_tokens(DECODE_MAX_TOKENS + 1, meta) == (head_rows > DECODE_MAX_TOKENS)
    llm.engine.shutdown()


# Penalties of a sampled step's rows: none, each alone, and together (a repetition below 1
# and a negative frequency favour the tokens instead); stop tokens held back (min_tokens;
# the test makes a row's likeliest tokens its stop tokens), alone and with a penalty.
PENALTIES = (dict(), dict(repetition_penalty=1.3), dict(frequency_penalty=0.7), dict(presence_penalty=0.9),
             dict(repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=0.4),
             dict(min_tokens=8), dict(min_tokens=8, frequency_penalty=0.6))

# Rows of a sampled step: greedy ones among them (temperature 0, top_k 1), and each truncation
# alone and together.
SAMPLED_ROWS = (dict(temperature=0.0), dict(temperature=0.8), dict(temperature=1.0, top_k=50),
                dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, min_p=0.05),
                dict(temperature=1.0, top_k=40, top_p=0.8, min_p=0.02), dict(temperature=0.8, top_k=1),
                dict(temperature=1.5, top_p=0.95))


@pytest.mark.parametrize("quantization, dtype", [in_bf16("gguf"), ("gguf", "float32"), in_bf16(None),
                                                 (None, "float32")])
def test_sampled_steps_draw_in_the_region_the_samplers_tokens(quantization, dtype):
    """Rows that draw at a temperature (with top_k, top_p, min_p) take their tokens in the
    region too: each is the token the sampler draws from compute_logits over run()'s hidden
    state, seeded alike (Sampler.token_sampling hands the loop the uniforms the sampler
    would draw), beside greedy rows' argmax, on one thread and on several; rows with
    penalties over their tokens (repetition, frequency, presence, alone and together; their
    outputs the row's likeliest tokens, so the penalties move the draw) or stop tokens held
    back by min_tokens (the likeliest tokens too) take the sampler's tokens as well
    (Sampler.token_history); and the rows that ask for logprobs (none, the token's only, its
    top 1 to 20) get the sampler's (Sampler.token_logprobs, loop_logprobs)."""
    llm, runner, loop = _four_layer_loop(quantization, dtype)
    vocab_size = llm.engine.model_config.vocab_size
    distinct = _prompts(7)
    num_drawn_apart = 0  # rows whose draw is not their argmax: the comparison sees the draws
    num_logprob_rows = 0
    threads_before = torch.get_num_threads()
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            # As many rows as the head's op takes in the region (GGUF's Q8_0 head on an AMX
            # CPU: q8_0_max_rows, 4).
            for num_seqs in (1, 3, min(len(SAMPLED_ROWS), loop.max_head_tokens)):
                prompts = [[t + 5 * i for t in distinct[i % 7]] for i in range(num_seqs)]
                rows = SAMPLED_ROWS[-num_seqs:] if num_seqs == 1 else SAMPLED_ROWS[:num_seqs]
                num_logprobs = [(None, 0, 1, 5, 20)[(i + num_threads) % 5] for i in range(num_seqs)]
                penalties = [PENALTIES[(i + num_threads) % len(PENALTIES)] for i in range(num_seqs)]
                with torch.inference_mode():
                    logits = runner.model.compute_logits(_decode_step(llm, prompts, loop))
                # Each row's output so far: its likeliest tokens, the first of them twice.
                outputs = [[ids[0], *ids] for ids in logits.topk(4, dim=-1).indices.tolist()]
                requests = [ScheduledRequest(f"r{i}", [p[-1]], len(p), [], True,
                                             SamplingParams(seed=100 * num_threads + i, logprobs=n, **row, **penalty,
                                                            stop_token_ids=output[1:3] if "min_tokens" in penalty
                                                            else []),
                                             prompt_token_ids=p, output_token_ids=output)
                            for i, (p, row, n, penalty, output)
                            in enumerate(zip(prompts, rows, num_logprobs, penalties, outputs))]
                sampler = Sampler()
                sampling = sampler.token_sampling(requests, 1)
                logprobs = Sampler.token_logprobs(requests, 1)
                got = _decode_step(llm, prompts, loop, greedy=True, sampling=sampling, logprobs=logprobs,
                                   history=sampler.token_history(requests, vocab_size))[:, 0]
                want = Sampler()(logits, requests)
                assert got.tolist() == want.sampled_token_ids, (num_threads, num_seqs)
                num_drawn_apart += sum(t != a for t, a in zip(want.sampled_token_ids, argmax_rows(logits).tolist()))
                if logprobs is None:
                    assert want.logprobs is None
                    continue
                num_logprob_rows += sum(n is not None for n in num_logprobs)
                assert Sampler.loop_logprobs(logprobs, 1) == [None if w is None else [w] for w in want.logprobs]
    finally:
        torch.set_num_threads(threads_before)
    assert num_drawn_apart >= 3 and num_logprob_rows >= 10
    llm.engine.shutdown()


def test_penalties_in_the_region_count_the_tokens_of_each_step():
    """Steps back to back with penalties or held-back stop tokens: each row's tokens and
    logprobs are those of as many single steps, each told the tokens taken before it (greedy
    rows with a strong repetition penalty leave their last token, so a step that did not
    count it would repeat it); a greedy row whose first two greedy tokens are its stop tokens,
    held back for three steps, takes neither before its fourth."""
    llm, runner, loop = _four_layer_loop("gguf", packed_dtype())
    vocab_size = llm.engine.model_config.vocab_size
    prompts = _prompts(3)
    num_steps = 5
    plain = _decode_step(llm, prompts, loop, greedy=True, num_steps=num_steps).tolist()
    held_back = plain[2][:2]
    params = [SamplingParams(temperature=0.0, repetition_penalty=3.0, logprobs=2),
              SamplingParams(temperature=0.9, seed=5, frequency_penalty=1.5, presence_penalty=0.5, logprobs=0),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=held_back)]
    block_size = llm.engine.config.cache.block_size
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(3)]

    def requests(outputs, step):
        return [ScheduledRequest(f"r{i}", [outputs[i][-1] if outputs[i] else p[-1]], len(p) + step, tables[i], True,
                                 params[i], prompt_token_ids=p, output_token_ids=outputs[i])
                for i, p in enumerate(prompts)]

    assert all(len(p) + num_steps < 4 * block_size for p in prompts)
    sampler = Sampler()
    first = requests([[], [], []], 0)
    burst_logprobs = sampler.token_logprobs(first, num_steps)
    burst = _decode_step(llm, prompts, loop, greedy=True, num_steps=num_steps,
                         sampling=sampler.token_sampling(first, num_steps), logprobs=burst_logprobs,
                         history=sampler.token_history(first, vocab_size))
    sampler = Sampler()
    single_logprobs = sampler.token_logprobs(first, 1)
    tokens = _decode_step(llm, prompts, loop, greedy=True, sampling=sampler.token_sampling(first, 1),
                          logprobs=single_logprobs, history=sampler.token_history(first, vocab_size))
    logprobs = [sampler.loop_logprobs(single_logprobs, 1)]
    outputs = [[t] for t in tokens[:, 0].tolist()]
    for step in range(1, num_steps):
        decode = requests(outputs, step)
        step_logprobs = sampler.token_logprobs(decode, 1)
        with torch.inference_mode():
            ids, positions, meta, _, _ = runner.prepare_inputs(decode)
            taken = loop.run_tokens(ids, positions, meta, 1, None, sampler.token_sampling(decode, 1),
                                    logprobs=step_logprobs, history=sampler.token_history(decode, vocab_size))
        logprobs.append(sampler.loop_logprobs(step_logprobs, 1))
        for output, token in zip(outputs, taken[:, 0].tolist()):
            output.append(token)
    assert burst.tolist() == outputs
    assert sampler.loop_logprobs(burst_logprobs, num_steps)[:2] == [
        [step[i][0] for step in logprobs] for i in range(2)]
    assert outputs[0][1] != outputs[0][0] and len(set(outputs[0])) == num_steps  # the penalty moved each one
    assert not set(outputs[2][:3]) & set(held_back) and outputs[2] != plain[2]
    llm.engine.shutdown()


def test_greedy_steps_back_to_back_take_the_tokens_and_write_the_kv_of_single_steps():
    """run_tokens's num_steps steps in one call: each row's tokens, and every K/V written,
    are those of as many single steps, each fed the token the last one took, across block
    boundaries (the rows' next slots read from their block tables)."""
    llm = LLM(dtype=packed_dtype(), kv_cache_memory="64MiB", quantization="gguf")
    runner = llm.engine.executor.runner
    prepack_linears(runner.model)
    loop = NativeDecodeLoop(runner.model, runner.kv_caches, num_layers=4)
    block_size = llm.engine.config.cache.block_size
    # Each prompt ends two positions before a block boundary: six steps cross it.
    prompts = [[(31 * i + 7 * n) % 40000 + 100 for i in range(n)]
               for n in (block_size - 2, 2 * block_size - 2, 3 * block_size - 2)]
    num_steps = 6
    burst = _decode_step(llm, prompts, loop, greedy=True, num_steps=num_steps)  # [3, num_steps]
    burst_kv = [(k.clone(), v.clone()) for k, v in runner.kv_caches[:4]]
    tokens = _decode_step(llm, prompts, loop, greedy=True)  # [3, 1]: the caches zeroed, the same 4 blocks each
    params = SamplingParams(temperature=0.0)
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(3)]
    for step in range(1, num_steps):
        decode = [ScheduledRequest(f"r{i}", [int(tokens[i, -1])], len(p) + step, tables[i], True, params)
                  for i, p in enumerate(prompts)]
        with torch.inference_mode():
            ids, positions, meta, _, _ = runner.prepare_inputs(decode)
            tokens = torch.cat([tokens, loop.run_tokens(ids, positions, meta)], dim=1)
    assert burst.tolist() == tokens.tolist()
    for (k, v), (burst_k, burst_v) in zip(runner.kv_caches[:4], burst_kv):
        assert torch.equal(k, burst_k) and torch.equal(v, burst_v)
    assert loop.num_token_steps == 2 * num_steps  # the burst, then one step and five
    # Stop tokens: the steps end once every row has taken one, and write nothing further.
    rows = burst.tolist()
    stops = [rows[0][2], rows[1][4], rows[2][1]]
    num_run = 1 + max(next(j for j, t in enumerate(row) if t in stops) for row in rows)
    assert num_run < num_steps
    cut = _decode_step(llm, prompts, loop, greedy=True, num_steps=num_steps, stop_token_ids=stops)
    assert cut.tolist() == [row[:num_run] for row in rows]
    for i, p in enumerate(prompts):
        slots = [4 * i * block_size + pos for pos in range(len(p) + num_run, len(p) + num_steps)]
        for k, v in runner.kv_caches[:4]:
            assert not k.view(-1, *k.shape[2:])[slots].any() and not v.view(-1, *v.shape[2:])[slots].any()
    llm.engine.shutdown()


def _with_and_without_the_head(llm, loop, prompts, params):
    """The outputs of params with the loop's head sampling what it can, the same with no head in
    the loop (its hidden states, then compute_logits and the sampler for every row), and the
    loop's token steps in the first run."""
    num_token_steps = loop.num_token_steps
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    num_token_steps = loop.num_token_steps - num_token_steps
    loop.max_head_tokens = 0
    want = [o.outputs[0] for o in llm.generate(prompts, params)]
    loop.max_head_tokens = DECODE_MAX_TOKENS
    return got, want, num_token_steps


def test_engine_steps_sample_in_the_loop():
    """An engine's decode steps take run_tokens and give the tokens the sampler gives from the
    head's logits: greedy rows, and seeded rows drawn at a temperature with truncations,
    penalties over their tokens, stop tokens held back by min_tokens, and their logprobs (the
    loop runs the sampler's own logprobs_rows code); a grammar's rows take the sampler, from
    the logits the loop's head left, beside the others: the same tokens and logprobs as with
    no head in the loop (its hidden states, then compute_logits and the sampler for every
    row)."""
    llm = LLM(dtype=packed_dtype(), kv_cache_memory="64MiB", quantization="gguf")
    loop = with_native_loop(llm)
    prompts = [{"prompt_token_ids": p} for p in _prompts(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert loop.num_token_steps >= 11
    loop.max_head_tokens = 0  # as a model without a head the loop runs
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert got == want
    loop.max_head_tokens = DECODE_MAX_TOKENS
    sampled = [greedy, SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True),
               SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.02, seed=2, max_tokens=12, ignore_eos=True)]
    num_token_steps = loop.num_token_steps
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)]
    assert loop.num_token_steps >= num_token_steps + 11 and got[1] != got[0]
    loop.max_head_tokens = 0  # the loop's hidden states, then compute_logits and the sampler
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)] == got
    loop.max_head_tokens = DECODE_MAX_TOKENS
    sampler = llm.engine.executor.runner.sampler
    sampler.samples_in_loop = False  # the head's logits from the loop, every draw by the sampler
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)] == got
    sampler.samples_in_loop = True
    sampler_rows = [
        [SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True, logprobs=2), sampled[1],
         SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)],
        [SamplingParams(temperature=0.7, seed=3, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                        frequency_penalty=0.5, logprobs=3),
         SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=4),
         SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6, presence_penalty=0.4)]]
    for params in sampler_rows:
        got, want, num_token_steps = _with_and_without_the_head(llm, loop, prompts, params)
        assert num_token_steps >= 11
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.logprobs for o in got] == [o.logprobs for o in want]
        assert [len(o.logprobs or []) for o in got] == [len(o.token_ids) if p.logprobs is not None else 0
                                                        for o, p in zip(got, params)]
    assert got[2].logprobs is None
    # A grammar's rows: the sampler masks them, from the head's logits, beside free rows.
    constrained = [SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"choice": ["yes", "no"]}),
                   sampled[1], SamplingParams(temperature=1.0, seed=4, max_tokens=12,
                                              structured_outputs={"regex": "[a-z]{3,6}"})]
    got, want, num_token_steps = _with_and_without_the_head(llm, loop, prompts, constrained)
    assert num_token_steps >= 11  # the free row's 12 tokens
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].text in ("yes", "no") and re.fullmatch("[a-z]{3,6}", got[2].text)
    # Rows with a logit_bias or allowed_token_ids: the sampler's too, beside free rows.
    allowed = [100, 200, 300, 400]
    adjusted = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={1000: 100}),
                sampled[1], SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True,
                                           allowed_token_ids=allowed, logprobs=1)]
    got, want, num_token_steps = _with_and_without_the_head(llm, loop, prompts, adjusted)
    assert num_token_steps >= 11
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    assert got[0].token_ids == [1000] * 12 and set(got[2].token_ids) <= set(allowed)
    assert all(set(lp.top_token_ids) <= set(allowed) for lp in got[2].logprobs)
    llm.engine.shutdown()


def test_engine_decode_steps_back_to_back_give_the_tokens_of_single_steps():
    """num_scheduler_steps: greedy decode-only steps run several to a call, and every
    request ends with the tokens of single steps: at max_tokens that are no multiple of the
    steps, at a stop token inside a burst, at EOS; seeded requests drawn at a temperature
    too, and their logprobs, penalties and stop tokens held back by min_tokens (the same as
    single steps'); the pool is whole again at the end. An engine without the loop keeps
    single steps."""
    llm = LLM(dtype=packed_dtype(), kv_cache_memory="64MiB", quantization="gguf", num_scheduler_steps=4)
    scheduler = llm.engine.scheduler
    runner = llm.engine.executor.runner
    assert scheduler.num_scheduler_steps == 1 and not runner.runs_decode_steps()  # eager: no loop, single steps
    loop = with_native_loop(llm)
    assert runner.runs_decode_steps()  # what a compiled engine's start asks
    calls = []  # the steps each call of the loop ran
    run_tokens = loop.run_tokens

    def counted(*args, **kwargs):
        token_ids = run_tokens(*args, **kwargs)
        calls.append(token_ids.shape[1])
        return token_ids

    loop.run_tokens = counted
    prompts = [{"prompt_token_ids": p} for p in _prompts(3)]

    def generate(params):
        return [o.outputs[0] for o in llm.generate(prompts, params)]

    def single_then_bursts(params):
        """The outputs with single steps, then with bursts of up to 4 (calls: the burst's)."""
        scheduler.num_scheduler_steps = 1
        single = generate(params)
        scheduler.num_scheduler_steps = 4
        calls.clear()
        return single, generate(params)

    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (13, 7, 10)]
    scheduler.num_scheduler_steps = 1
    want = generate(greedy)
    assert set(calls) == {1}
    scheduler.num_scheduler_steps = 4
    calls.clear()
    got = generate(greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert max(calls) == 4 and len(calls) < sum(calls)
    # A stop token that first comes inside a burst (the prompt's step gives token 0, then
    # bursts of four), and EOS where it comes.
    first = want[0].token_ids
    stop = next(t for i, t in enumerate(first) if i > 1 and (i - 1) % 4 in (1, 2) and t not in first[:i])
    stopping = [SamplingParams(temperature=0.0, max_tokens=13, stop_token_ids=[stop]),
                SamplingParams(temperature=0.0, max_tokens=40), SamplingParams(temperature=0.0, max_tokens=10)]
    scheduler.num_scheduler_steps = 1
    want = generate(stopping)
    scheduler.num_scheduler_steps = 4
    got = generate(stopping)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert got[0].token_ids[-1] == stop and got[0].finish_reason == "stop"
    # A lone request's steps end at its stop token: none run past it.
    steps_before = loop.num_token_steps
    (alone,) = [o.outputs[0] for o in llm.generate(prompts[:1], stopping[0])]
    assert alone.token_ids == got[0].token_ids
    assert loop.num_token_steps - steps_before == len(alone.token_ids) - 1  # the prompt's step took the first
    sampled = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
               SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True),
               SamplingParams(temperature=1.0, top_p=0.9, seed=2, max_tokens=10, ignore_eos=True)]
    want, got = single_then_bursts(sampled)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert max(calls) == 4 and len(calls) < sum(calls)
    with_logprobs = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0,
                                    repetition_penalty=1.5),
                     SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True, logprobs=3,
                                    frequency_penalty=0.8, presence_penalty=0.3),
                     SamplingParams(temperature=1.0, top_p=0.9, seed=2, max_tokens=10, ignore_eos=True)]
    want, got = single_then_bursts(with_logprobs)
    assert [(o.token_ids, o.logprobs) for o in got] == [(o.token_ids, o.logprobs) for o in want]
    assert len(got[1].logprobs) == 12 and len(got[1].logprobs[0].top_token_ids) == 3 and got[2].logprobs is None
    assert max(calls) == 4 and len(calls) < sum(calls)
    # Stop tokens held back (min_tokens; EOS among them) count down inside a burst.
    holding_back = [SamplingParams(temperature=0.0, max_tokens=20, min_tokens=7,
                                   stop_token_ids=[want[0].token_ids[3]]),
                    SamplingParams(temperature=0.8, seed=1, max_tokens=12, min_tokens=6), greedy[2]]
    want, got = single_then_bursts(holding_back)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert calls[0] == 4 and len(got[0].token_ids) >= 7
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    llm.engine.shutdown()


def test_token_steps_bad_calls_raise_and_write_nothing(tiny_llama_dir, monkeypatch):
    """A token id outside the embedding, more rows than the head's GEMV takes, or sampling,
    logprobs or penalties arguments out of shape or range raise ValueError before anything is
    written; a model registered without a head the region can run (fp32 rows here:
    PDSERVE_PANEL_GEMM=0) has no token steps."""
    llm = LLM(dtype="float32", kv_cache_memory="32MiB", quantization="gguf")
    runner = llm.engine.executor.runner
    prepack_linears(runner.model)
    loop = NativeDecodeLoop(runner.model, runner.kv_caches, num_layers=2)
    most = loop.max_head_tokens  # the Q8_0 head's GEMV rows
    assert most == max(DECODE_MAX_TOKENS, q8_0_max_rows())
    vocab_size = runner.model.embed_tokens.weight.shape[0]
    for cache in (*loop.k_caches, *loop.v_caches):
        cache.zero_()

    def call(ids, model_id=loop.model_id, sampling=None, logits=None, logprobs=None, history=None):
        n = len(ids)
        return decode_tokens(model_id, torch.tensor(ids), torch.zeros(n, dtype=torch.int64), loop.k_caches,
                             loop.v_caches, torch.arange(n), torch.arange(n, dtype=torch.int32).view(n, 1),
                             torch.arange(n + 1, dtype=torch.int32), torch.ones(n, dtype=torch.int32),
                             sampling=sampling, logits=logits, logprobs=logprobs, history=history)

    for ids, message in (([vocab_size], "outside the embedding"), ([5, -1], "outside the embedding"),
                         ([5] * (most + 1), f"1 to {most} tokens")):
        with pytest.raises(ValueError, match=message):
            call(ids)
    temperatures, uniforms = torch.tensor([0.0, 0.8]), torch.tensor([[0.5, 0.25]], dtype=torch.float64)
    for sampling, message in (
            (TokenSampling(temperatures, None), "temperatures and uniforms together"),
            (TokenSampling(None, None, top_p=torch.tensor([0.9, 0.9])), "need temperatures"),
            (TokenSampling(torch.tensor([0.8]), uniforms), "temperatures must be contiguous"),
            (TokenSampling(temperatures, uniforms.float()), "uniforms must be contiguous"),
            (TokenSampling(temperatures, uniforms.view(2, 1)), "uniforms must be contiguous"),
            (TokenSampling(temperatures, torch.tensor([[0.5, 1.0]], dtype=torch.float64)), "outside \\[0, 1\\)"),
            (TokenSampling(torch.tensor([0.8, float("nan")]), uniforms), "is not finite"),
            (TokenSampling(temperatures, uniforms, top_k=torch.tensor([5, 5], dtype=torch.int32)), "top_k must be"),
            (TokenSampling(temperatures, uniforms, top_p=torch.tensor([0.9, 0.0])), "top_p 0(\\.0*)? is outside"),
            (TokenSampling(temperatures, uniforms, min_p=torch.tensor([1.5, 0.1])), "min_p 1.50* is outside")):
        with pytest.raises(ValueError, match=message):
            call([5, 6], sampling=sampling)
    room = TokenLogprobs.empty([3, -1], 1)  # [1, 2, 4] values, [1, 2, 3] ids
    for logprobs, message in (
            (TokenLogprobs(room.num_logprobs, room.logprobs, None), "together, or none"),
            (TokenLogprobs(room.num_logprobs.int(), *room[1:]), "num_logprobs must be contiguous"),
            (TokenLogprobs(torch.tensor([3, -1, 2]), *room[1:]), "num_logprobs must be contiguous"),
            (TokenLogprobs(torch.tensor([vocab_size + 1, 0]), *room[1:]), "more than the vocabulary"),
            (TokenLogprobs(room.num_logprobs, room.logprobs[..., :3], room.token_ids), "logprobs must be contiguous"),
            (TokenLogprobs(room.num_logprobs, room.logprobs.double(), room.token_ids), "logprobs must be contiguous"),
            (TokenLogprobs(room.num_logprobs, room.logprobs, room.token_ids.int()), "logprob_token_ids must be"),
            (TokenLogprobs(room.num_logprobs, room.logprobs, room.token_ids[..., :2]), "logprob_token_ids must be")):
        with pytest.raises(ValueError, match=message):
            call([5, 6], logprobs=logprobs)
    values, token_ids = torch.tensor([[1.2, 0.5, 0.0], [1.0, 0.0, 0.0]]), torch.tensor([3, 4, 5, 2])
    offsets, held_back = torch.tensor([[0, 1, 3, 3], [3, 3, 3, 4]]), torch.tensor([0, 2])
    for history, message in (
            (TokenHistory(values, token_ids, offsets, None), "together, or none"),
            (TokenHistory(values.double(), token_ids, offsets, held_back), "penalties must be contiguous fp32"),
            (TokenHistory(values[:1], token_ids, offsets, held_back), "penalties must be contiguous fp32"),
            (TokenHistory(values, token_ids, offsets.int(), held_back), "history_offsets must be contiguous"),
            (TokenHistory(values, token_ids, offsets[:, :3], held_back), "history_offsets must be contiguous"),
            (TokenHistory(values, token_ids, offsets, held_back.int()), "held_back_steps must be contiguous"),
            (TokenHistory(values, token_ids.view(2, 2), offsets, held_back), "history_token_ids must be contiguous"),
            (TokenHistory(values, torch.tensor([3, vocab_size, 5, 2]), offsets, held_back),
             f"token id {vocab_size} is outside"),
            (TokenHistory(values, torch.tensor([3, 4, 5, -1]), offsets, held_back), "token id -1 is outside"),
            (TokenHistory(torch.tensor([[0.0, 0.5, 0.0], [1.0, 0.0, 0.0]]), token_ids, offsets, held_back),
             "repetition > 0"),
            (TokenHistory(torch.tensor([[1.2, float("inf"), 0.0], [1.0, 0.0, 0.0]]), token_ids, offsets, held_back),
             "must be finite"),
            (TokenHistory(values, token_ids, torch.tensor([[0, 2, 1, 3], [3, 3, 3, 4]]), held_back), "are not ordered"),
            (TokenHistory(values, token_ids, torch.tensor([[0, 1, 3, 3], [3, 3, 4, 5]]), held_back),
             "are not ordered")):
        with pytest.raises(ValueError, match=message):
            call([5, 6], history=history)
    for logits in (torch.empty(2, loop.head_outputs - 1), torch.empty(2, loop.head_outputs, dtype=torch.bfloat16),
                   torch.empty(3, loop.head_outputs), torch.empty(loop.head_outputs, 2).t()):
        with pytest.raises(ValueError, match="logits must be contiguous"):
            call([5, 6], logits=logits)
    block_size = loop.k_caches[0].shape[1]
    max_position = runner.model.rope.cos.shape[0]

    def steps(position, num_steps, num_blocks=1, logits=None):
        return decode_tokens(loop.model_id, torch.tensor([5]), torch.tensor([position]), loop.k_caches,
                             loop.v_caches, torch.tensor([position % block_size]),
                             torch.zeros(1, num_blocks, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                             torch.tensor([position + 1], dtype=torch.int32), num_steps, logits=logits)

    for position, num_steps, num_blocks, message in (
            (0, 0, 1, "num_steps must be at least 1"),
            (block_size - 2, 3, 1, "block table ends before position"),  # its next block is not in the table
            (max_position - 2, 3, max_position // block_size + 1, "outside the RoPE table")):
        with pytest.raises(ValueError, match=message):
            steps(position, num_steps, num_blocks)
    with pytest.raises(ValueError, match="of one step"):
        steps(0, 2, logits=torch.empty(1, loop.head_outputs))
    assert all(not cache.any() for cache in (*loop.k_caches, *loop.v_caches))
    logits = torch.full((2, loop.head_outputs), float("nan"))
    assert call([5, 6], logits=logits).tolist() == argmax_rows(logits[:, :vocab_size]).view(2, 1).tolist()
    assert loop.k_caches[1].any()
    llm.engine.shutdown()
    monkeypatch.setenv("PDSERVE_PANEL_GEMM", "0")
    rows = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16)
    loop = with_native_loop(rows)
    assert loop.max_head_tokens == decode_model_max_head_tokens(loop.model_id) == 0
    with pytest.raises(ValueError, match="has no head this loop can run"):
        call([5], model_id=loop.model_id)
    rows.engine.shutdown()


def test_the_regions_switch_turns_them_off(monkeypatch):
    """PDSERVE_DECODE_REGIONS=0: a model of GGUF blocks forks and joins per projection."""
    monkeypatch.setenv("PDSERVE_DECODE_REGIONS", "0")
    llm = LLM(dtype="float32", kv_cache_memory="32MiB", quantization="gguf")
    runner = llm.engine.executor.runner
    prepack_linears(runner.model)
    assert not NativeDecodeLoop(runner.model, runner.kv_caches, num_layers=2).in_regions
    monkeypatch.setenv("PDSERVE_DECODE_REGIONS", "1")
    assert NativeDecodeLoop(runner.model, runner.kv_caches, num_layers=2).in_regions
    llm.engine.shutdown()


def test_in_one_region_bad_calls_raise_and_write_nothing():
    """The region form checks everything its attention would, before the region (where an
    error could not be raised): a slot past the cache or a block table entry outside it
    raises ValueError, and no cache is written."""
    llm = LLM(dtype="float32", kv_cache_memory="32MiB", quantization="gguf")
    runner = llm.engine.executor.runner
    prepack_linears(runner.model)
    loop = NativeDecodeLoop(runner.model, runner.kv_caches, num_layers=2)
    assert loop.in_regions
    hidden_size = llm.engine.model_config.hidden_size
    num_slots = loop.k_caches[0].shape[0] * loop.k_caches[0].shape[1]
    for cache in (*loop.k_caches, *loop.v_caches):
        cache.zero_()

    def call(slot=0, block=0):
        return decode_layers(loop.model_id, torch.randn(1, hidden_size), torch.zeros(1, dtype=torch.int64),
                             loop.k_caches, loop.v_caches, torch.tensor([slot]),
                             torch.tensor([[block]], dtype=torch.int32), torch.arange(2, dtype=torch.int32),
                             torch.ones(1, dtype=torch.int32))

    with pytest.raises(ValueError, match="past the cache"):
        call(slot=num_slots)
    with pytest.raises(ValueError, match="outside the cache"):
        call(block=loop.k_caches[0].shape[0])
    assert all(not cache.any() for cache in (*loop.k_caches, *loop.v_caches))
    assert call().shape == (1, hidden_size)
    assert loop.k_caches[1].any()
    llm.engine.shutdown()


@pytest.mark.parametrize("panel_gemm, kind", [("1", LINEAR_PANELS), ("0", LINEAR_DENSE)])
def test_fp32_linears_in_the_loop_give_the_models_tokens(tiny_llama_dir, monkeypatch, panel_gemm, kind):
    """An fp32 model's projections keep fp32 panels wherever the library is built, row-major
    copies with PDSERVE_PANEL_GEMM=0: the loop takes them (panels in one region a step, as
    far as the prepacked op takes panels; rows for steps of up to four tokens, larger ones
    through the prepacked op's oneDNN) and gives the tokens and logprobs of the eager model
    (F.linear)."""
    options = dict(dtype="float32", num_kv_blocks=160, block_size=4)
    eager = LLM(str(tiny_llama_dir), **options)
    prompts = parity_prompts()
    batch, max_tokens = [*prompts, prompts[0][:3]], [3, 6, 9, 12, 5]
    want = _generate(eager, batch, max_tokens)
    eager.engine.shutdown()
    monkeypatch.setenv("PDSERVE_PANEL_GEMM", panel_gemm)
    llm = LLM(str(tiny_llama_dir), **options)
    loop = with_native_loop(llm)
    kinds = {decode_weight(linear)[1] for layer in llm.engine.executor.runner.model.layers
             for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                            layer.mlp.down_proj)}
    assert kinds == {kind} and loop.in_regions == (kind == LINEAR_PANELS)
    steps_before = loop.num_steps
    _assert_same(_generate(llm, batch, max_tokens), want, FP32_LOGPROB_ATOL)
    assert loop.num_steps > steps_before
    llm.engine.shutdown()


def test_row_major_models_fork_per_projection(tiny_llama_dir, monkeypatch):
    """Row-major projections (fp32 with PDSERVE_PANEL_GEMM=0) keep a fork and join per
    projection (their own ops)."""
    monkeypatch.setenv("PDSERVE_PANEL_GEMM", "0")
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16)
    assert not with_native_loop(llm).in_regions
    llm.engine.shutdown()


def test_families_it_does_not_serve_keep_the_model(tmp_path_factory, bundled_model_dir, caplog):
    llm = LLM(str(_family_dir(tmp_path_factory, bundled_model_dir, "qwen3")), dtype="float32", num_kv_blocks=16)
    with caplog.at_level("INFO", logger="common.engine.native_decode"):
        assert with_native_loop(llm) is None
    assert "not Llama's layer" in caplog.text
    llm.engine.shutdown()


def test_the_switch_turns_it_off(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("PDSERVE_NATIVE_DECODE", "0")
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16)
    assert with_native_loop(llm) is None
    llm.engine.shutdown()


def test_bad_calls_raise_and_write_nothing(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("PDSERVE_PANEL_GEMM", "0")  # row-major fp32 weights, refused below as panels
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16, block_size=4)
    loop = with_native_loop(llm)
    hidden_size = llm.engine.model_config.hidden_size
    k_caches, v_caches, loop_id = loop.k_caches, loop.v_caches, loop.model_id

    def call(num_tokens=1, positions=None, model_id=loop_id, slots=None):
        hidden = torch.randn(num_tokens, hidden_size)
        positions = torch.zeros(num_tokens, dtype=torch.int64) if positions is None else positions
        slots = torch.arange(num_tokens, dtype=torch.int64) if slots is None else slots
        return decode_layers(model_id, hidden, positions, k_caches, v_caches, slots,
                             torch.zeros((num_tokens, 1), dtype=torch.int32),
                             torch.arange(num_tokens + 1, dtype=torch.int32), torch.ones(num_tokens, dtype=torch.int32))

    assert call().shape == (1, hidden_size)
    # Every projection prepacked: any number of tokens, as the library tells the loop.
    assert loop.max_num_tokens == decode_model_max_tokens(loop_id) == sys.maxsize
    assert call(num_tokens=DECODE_MAX_TOKENS + 5).shape == (DECODE_MAX_TOKENS + 5, hidden_size)
    with pytest.raises(ValueError, match="no model is registered as 12345"):
        decode_model_max_tokens(12345)
    # Row-major fp32 weights registered as panels, or a kind it does not know: refused.
    tensors = _model_tensors(llm.engine.executor.runner.model, None)
    with pytest.raises(ValueError, match=r"panels must be a bf16 model's contiguous bf16 \[N / 32, K / 2, 32, 2\]"):
        register_decode_model(**{**tensors, "kinds": [LINEAR_PANELS] * len(tensors["kinds"])})
    with pytest.raises(ValueError, match="linear kind 4 is not"):
        register_decode_model(**{**tensors, "kinds": [4] * len(tensors["kinds"])})
    for cache in (*k_caches, *v_caches):
        cache.zero_()
    num_slots = k_caches[0].shape[0] * k_caches[0].shape[1]
    cases = [(dict(num_tokens=0), "1 to .* tokens"),
             (dict(positions=torch.tensor([10_000])), "outside the RoPE table"),
             (dict(model_id=12345), "no model is registered"),
             (dict(slots=torch.tensor([num_slots])), "past the cache")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**kwargs)
    assert all(not cache.any() for cache in (*k_caches, *v_caches))
    # Once the loop goes, so does its registration.
    llm.engine.executor.runner.native_decode = None
    del loop
    gc.collect()
    with pytest.raises(ValueError, match="no model is registered"):
        call()
    llm.engine.shutdown()
