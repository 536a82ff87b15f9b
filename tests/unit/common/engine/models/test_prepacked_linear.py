"""Prepacked linears: the same product as F.linear, eagerly and compiled, a weight table
that numbers a model's weights the same way in every process, and the model pass; what
decode steps stream (GEMV copies, the KV cache) on huge pages."""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
import torch.nn.functional as F

from common.engine.models import prepacked_linear
from common.engine.models.prepacked_linear import PrepackedLinear, prepack_linears, prepacking_available
from kernels.cpu_linear import native_gemv_available
from kernels.huge_pages import huge_pages_available
from tests.conftest import load_cpu_model
from tests.support.memory_maps import mapping_of

pytestmark = pytest.mark.skipif(not prepacking_available(torch.float32), reason="oneDNN cannot pack here")

# fp32 oneDNN and the default GEMM differ in summation order only; bf16 results are
# rounded to bf16 (one ulp at |y| ~ 10 is 0.0625).
TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-1)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 130])
def test_prepacked_linear_matches_f_linear(dtype, with_bias, num_tokens):
    if not prepacking_available(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype) if with_bias else None
    x = torch.randn(num_tokens, 64, dtype=dtype)
    layer = PrepackedLinear(weight, bias)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), **TOLERANCES[dtype])
    # The packed copy is the module's own: changing the source weight changes nothing.
    before = layer(x)
    weight.zero_()
    torch.testing.assert_close(layer(x), before, rtol=0, atol=0)


def test_onednn_takes_rows_rounded_to_a_few_hundred_counts():
    # A new row count costs oneDNN a primitive (a JIT compile) per linear shape: every step
    # size up to 4,096 tokens maps to few counts, each at most 3.1% (or 15 rows) larger.
    counts = [prepacked_linear.onednn_rows(n) for n in range(1, 4097)]
    assert all(n <= rows <= max(n + 15, n * 1.032) for n, rows in zip(range(1, 4097), counts))
    assert len(set(counts)) < 200 and counts[2047] == 2048 and prepacked_linear.onednn_rows(0) == 0
    if native_gemv_available():  # the native op's own copy of the rule
        assert [torch.ops.pdserve_gemv.onednn_rows(n) for n in range(1, 4097)] == counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_padded_for_onednn_give_the_product_of_the_rows_given(dtype):
    if not prepacking_available(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    torch.manual_seed(1)
    weight, bias = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    layer = PrepackedLinear(weight, bias)
    for num_tokens in (517, 1000):  # padded to 528 and 1,008 rows
        x = torch.randn(num_tokens, 64, dtype=dtype)
        expected = F.linear(x, weight, bias)
        for op in (torch.ops.pdserve.prepacked_linear, layer):  # the Python op, and the native one where loaded
            y = op(x, bias, layer.weight_id_tensor, 96) if op is not layer else layer(x)
            assert y.shape == (num_tokens, 96) and y.is_contiguous()
            torch.testing.assert_close(y, expected, **TOLERANCES[dtype])


def test_a_freed_weights_slot_is_reused_so_a_process_numbers_weights_the_same_way():
    gc.collect()
    first = [PrepackedLinear(torch.randn(8, 4), None) for _ in range(3)]
    ids = [layer.weight_id for layer in first]
    assert ids == sorted(ids) and len(set(ids)) == 3
    del first
    gc.collect()
    again = [PrepackedLinear(torch.randn(8, 4), None) for _ in range(3)]
    assert [layer.weight_id for layer in again] == ids


def test_a_compiled_graph_reaches_the_packed_weight_through_the_op():
    torch.manual_seed(0)
    weight, bias = torch.randn(32, 16), torch.randn(32)
    layer = PrepackedLinear(weight, bias)

    def block(x):  # [num_tokens, 16] -> [num_tokens, 32]
        return F.silu(layer(x * 2.0)) + 1.0

    compiled = torch.compile(block, dynamic=True, fullgraph=True)
    for num_tokens in (1, 5, 33):
        x = torch.randn(num_tokens, 16)
        torch.testing.assert_close(compiled(x), F.silu(F.linear(x * 2.0, weight, bias)) + 1.0,
                                   **TOLERANCES[torch.float32])


def test_prepack_linears_replaces_every_projection_and_packs_the_head(tiny_llama_dir):
    torch.manual_seed(0)
    model = load_cpu_model(tiny_llama_dir)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    inputs = {name: torch.randn(3, m.in_features) for name, m in linears.items()}
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.inference_mode():
        want = {name: m(inputs[name]) for name, m in linears.items()}
        want_logits = model.compute_logits(hidden)
        assert prepack_linears(model) == len(linears) + 1  # the projections and the (tied) head
        for name, x in inputs.items():
            assert isinstance(model.get_submodule(name), PrepackedLinear)
            torch.testing.assert_close(model.get_submodule(name)(x), want[name], **TOLERANCES[torch.float32])
        logits = model.compute_logits(hidden)  # [3, vocab_size], the padding rows cut
    assert logits.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(logits, want_logits, **TOLERANCES[torch.float32])
    # A packed model packs nothing again: it keeps its head.
    head = model.prepacked_head
    assert prepack_linears(model) == 0
    assert model.prepacked_head is head


@pytest.mark.skipif(not prepacking_available(torch.bfloat16), reason="oneDNN cannot pack bf16 here")
def test_greedy_rows_take_the_packed_heads_own_output(tiny_llama_dir):
    # Greedy steps take the bf16 head's output as it is: compute_logits' values before their
    # fp32 copy, so every argmax (ties, sliced padding columns) is the same.
    model = load_cpu_model(tiny_llama_dir, torch.bfloat16)
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        assert model.compute_argmax_logits(hidden) is None  # nothing packed: nothing to spare
        prepack_linears(model)
        logits = model.compute_logits(hidden)  # [5, vocab_size] fp32
        argmax_logits = model.compute_argmax_logits(hidden)  # [5, vocab_size] bf16
        assert argmax_logits.dtype == torch.bfloat16 and argmax_logits.shape == logits.shape
        assert torch.equal(argmax_logits.float(), logits)
        assert torch.equal(argmax_logits.argmax(dim=-1), logits.argmax(dim=-1))
        model.config = dataclasses.replace(model.config, final_logit_softcapping=30.0)
        assert model.compute_argmax_logits(hidden) is None


def test_nothing_is_packed_where_onednn_cannot(monkeypatch, tiny_llama_dir):
    model = load_cpu_model(tiny_llama_dir)
    monkeypatch.setattr(prepacked_linear, "prepacking_available", lambda dtype: False)
    assert prepack_linears(model) == 0
    assert model.prepacked_head is None
    assert any(isinstance(m, torch.nn.Linear) for m in model.modules())


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages here")
def test_what_decode_steps_stream_lives_on_huge_pages():
    # The GEMV's row-major copies and column panels: a decode step reads them whole. (The KV
    # cache is not there: kernels/huge_pages.py says why.)
    layer = PrepackedLinear(torch.randn(96, 64), None)
    if layer._row_major is None and layer._panels is None:
        pytest.skip("no native GEMV here: no decode copy")
    for decode_copy in (layer._row_major, layer._panels):  # one of them: panels unless PDSERVE_PANEL_GEMM=0
        assert decode_copy is None or mapping_of(decode_copy)["THPeligible"] == "1"
    if prepacking_available(torch.bfloat16):
        bf16_layer = PrepackedLinear(torch.randn(96, 64, dtype=torch.bfloat16), None)
        for decode_copy in (bf16_layer._row_major, bf16_layer._panels):  # one of them, by the CPU
            assert decode_copy is None or mapping_of(decode_copy)["THPeligible"] == "1"
