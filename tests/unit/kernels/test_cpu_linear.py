"""The native GEMVs (kernels/cpu/gemv.cpp) and the column-panel GEMMs (panel_gemm.h for bf16,
panel_gemm_fp32.h for fp32, whose AVX2 build takes an fp32 model's decode steps on CPUs
without AVX-512): for a bf16 or fp32 weight and for GGUF's
Q4_1 and Q8_0 blocks, the product fp32 math gives on the same inputs, rounded once to the
output dtype, for every row count and shape they take, in whichever build this CPU gets
(AVX512-BF16 dot products, or fp32 FMAs on AVX2; the GGUF blocks' products take x
quantized per block to int8 in every build, and the reference does the same), and the
AVX2 build's GGUF GEMVs on an AVX-512 machine; clear refusals for the ones they do not;
the decode linears that take them, and the native ops that pick between a GEMV and
oneDNN or torch's int4 / int8 kernels."""
from __future__ import annotations

import gc
import json
import os
import textwrap
from dataclasses import fields

import pytest
import torch
import torch.nn.functional as F

from common.engine.device import first_cpu_fields
from common.engine.model_files import bundled_gguf_path
from common.engine.models.prepacked_linear import _PACKED_WEIGHTS, PrepackedLinear, prepacking_available
from common.engine.models.quantization.cpu_kernels import int4_kernel_available, int8_kernel_available
from common.engine.models.quantization.gguf_blocks import GGUFQuantizedWeights, Q4_1Blocks, Q8_0Blocks
from common.engine.models.quantization.int8_linear import Int8Linear
from common.engine.models.quantization.q4_1_linear import Q4_1Linear
from kernels.cpu.build import cpu_flags
from kernels.cpu_linear import (GEMV_MAX_ROWS, GGUF_GROUP_ROWS, f32_panel_gemm_max_rows, gemv,
                                gguf_prompt_gemm_available, native_gemv_available, pack_panels, panel_gemm,
                                panel_gemm_amx_built, panel_gemm_amx_tiles, panel_gemm_available,
                                panel_gemm_max_rows, panels_for_any_rows, q4_1_gemv, q4_1_gemv_blocks, q8_0_gemv,
                                q8_0_gemv_blocks, q8_0_max_rows)
from kernels.cpu_linear import prepacked_linear as native_prepacked_linear
from kernels.cpu_linear import int8_linear
from kernels.cpu_linear import q4_1_linear as native_q4_1_linear
from tests.support.cpu_targets import avx2_build_environment
from tests.support.fresh_process import run_python, run_python_ok

pytestmark = pytest.mark.skipif(not native_gemv_available(),
                                reason="no AVX2 and FMA (or no C++ compiler): the GEMV is not built here")


def reference(x, bias, weight):  # fp32 math on the same bf16 inputs
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@pytest.mark.parametrize("num_rows", range(1, GEMV_MAX_ROWS + 1))
@pytest.mark.parametrize("out_features, in_features", [(1, 32), (63, 96), (960, 576), (576, 1536), (130, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_fp32_math_rounded_once(num_rows, out_features, in_features, with_bias, dtype):
    torch.manual_seed(num_rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, dtype=dtype)
    bias = torch.randn(out_features, dtype=dtype) if with_bias else None
    x = torch.randn(num_rows, in_features, dtype=dtype)
    out = gemv(x, bias, weight)
    assert out.shape == (num_rows, out_features) and out.dtype == dtype
    expected = reference(x, bias, weight)
    scale = expected.abs().max().item()
    if dtype == torch.bfloat16:
        # One bf16 rounding of the fp32 sum (half an ulp: 2^-9 relative), plus fp32
        # summation-order noise.
        torch.testing.assert_close(out.float(), expected, rtol=2 ** -8, atol=1e-3 * scale)
    else:  # fp32 throughout: only the summation order differs
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_are_independent(dtype):
    torch.manual_seed(0)
    weight = torch.randn(200, 64, dtype=dtype)
    x = torch.randn(GEMV_MAX_ROWS, 64, dtype=dtype)
    together = gemv(x, None, weight)
    for row in range(GEMV_MAX_ROWS):
        assert torch.equal(gemv(x[row:row + 1], None, weight), together[row:row + 1])


@pytest.mark.parametrize("x, weight, message", [
    (torch.zeros(GEMV_MAX_ROWS + 1, 32, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16),
     f"1 to {GEMV_MAX_ROWS} rows of x, got {GEMV_MAX_ROWS + 1}"),
    (torch.zeros(1, 40, dtype=torch.bfloat16), torch.zeros(8, 40, dtype=torch.bfloat16), "multiple of 32, got 40"),
    (torch.zeros(1, 32, dtype=torch.half), torch.zeros(8, 32, dtype=torch.half), "bf16 or fp32"),
    (torch.zeros(1, 32), torch.zeros(8, 32, dtype=torch.bfloat16), r"x must be BFloat16 \[M, K\], got Float \[1, 32\]"),
    (torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(8, 32), "x must be Float"),
    (torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16),
     "x has 32 columns, the weight 64"),
    (torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(32, 8, dtype=torch.bfloat16).t(), "contiguous"),
])
def test_refuses_what_it_cannot_compute(x, weight, message):
    with pytest.raises(RuntimeError, match=message):
        gemv(x, None, weight)


def test_refuses_a_bias_of_another_dtype():
    with pytest.raises(RuntimeError, match="a contiguous Float bias of 8 values expected"):
        gemv(torch.zeros(1, 32), torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, 32))


needs_panel_gemm = pytest.mark.skipif(not panel_gemm_available(), reason="panel_gemm needs AVX512-BF16")


@needs_panel_gemm
@pytest.mark.parametrize("out_features, in_features", [(32, 2), (64, 34), (96, 96), (960, 576), (576, 1536)])
def test_pack_panels_lays_out_32_columns_by_pairs_of_k(out_features, in_features):
    torch.manual_seed(out_features)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    panels = pack_panels(weight)
    assert panels.shape == (out_features // 32, in_features // 2, 32, 2) and panels.is_contiguous()
    # panels[p, kp, c, t] == weight[p * 32 + c, kp * 2 + t]
    expected = weight.view(out_features // 32, 32, in_features // 2, 2).permute(0, 2, 1, 3)
    assert torch.equal(panels, expected)
    # Written straight into huge-page memory, as PrepackedLinear keeps them: the same values.
    assert torch.equal(pack_panels(weight, huge_pages=True), expected)


@needs_panel_gemm
@pytest.mark.parametrize("num_rows", [1, 5, 7, 11, 12, 13, 14, 16, 19, 24, 26, 33, 37, 128, 200])
@pytest.mark.parametrize("out_features, in_features", [(32, 32), (64, 34), (96, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_gemm_matches_fp32_math_rounded_once(num_rows, out_features, in_features, with_bias):
    # Row counts off the vector tiles' 12 rows and AMX's 16 and both sides of them (one, two,
    # three blocks of 16 and an odd number of blocks with a partial last), tails of 7-11
    # rows alone and after whole tiles, tails of 1 and 2 rows joined to the last whole tile
    # (13 and 14 rows: alone, after one, after two); one panel (one thread) to 30; K not a
    # multiple of 32 (the vector tiles on AMX CPUs too).
    torch.manual_seed(num_rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(num_rows, in_features, dtype=torch.bfloat16)
    out = panel_gemm(x, bias, pack_panels(weight))
    assert out.shape == (num_rows, out_features) and out.dtype == torch.bfloat16
    expected = reference(x, bias, weight)
    scale = expected.abs().max().item()
    # One bf16 rounding of the fp32 sum (half an ulp: 2^-9 relative), plus summation-order noise.
    torch.testing.assert_close(out.float(), expected, rtol=2 ** -8, atol=1e-3 * scale)


@needs_panel_gemm
@pytest.mark.parametrize("num_rows", [12, 64])
def test_panel_gemm_outputs_past_l2_size_match_as_well(num_rows):
    # 64 x 10240 bf16 outputs (1.3 MB) take the path that asks for the next panel's output
    # lines ahead; 12 rows (240 KB) do not.
    torch.manual_seed(num_rows)
    weight, bias = torch.randn(10240, 64, dtype=torch.bfloat16), torch.randn(10240, dtype=torch.bfloat16)
    x = torch.randn(num_rows, 64, dtype=torch.bfloat16)
    expected = reference(x, bias, weight)
    torch.testing.assert_close(panel_gemm(x, bias, pack_panels(weight)).float(), expected, rtol=2 ** -8,
                               atol=1e-3 * expected.abs().max().item())


_VECTOR_TILES_SCRIPT = textwrap.dedent("""
    import torch
    from kernels.cpu_linear import pack_panels, panel_gemm, panel_gemm_amx_tiles, panel_gemm_max_rows
    assert not panel_gemm_amx_tiles() and panel_gemm_max_rows() == 8, panel_gemm_max_rows()
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    for num_rows in (1, 8, 17):
        x = torch.randn(num_rows, 64, dtype=torch.bfloat16)
        expected = torch.addmm(bias.float(), x.float(), weight.float().t())
        torch.testing.assert_close(panel_gemm(x, bias, pack_panels(weight)).float(), expected, rtol=2 ** -8,
                                   atol=1e-3 * expected.abs().max().item())
    print("ok")
""")


@needs_panel_gemm
@pytest.mark.skipif(not panel_gemm_amx_built(), reason="the library has no AMX tiles here")
def test_panel_gemm_without_the_amx_tiles_takes_its_vector_tiles_for_8_rows_at_most():
    run_python_ok(_VECTOR_TILES_SCRIPT, timeout_s=120, PDSERVE_AMX_TILES="0")


@needs_panel_gemm
@pytest.mark.skipif(not prepacking_available(torch.bfloat16), reason="oneDNN cannot pack bf16 here")
def test_on_amx_tiles_a_weight_whose_in_features_no_tile_step_divides_gets_no_panels():
    torch.manual_seed(0)
    weight = torch.randn(64, 34, dtype=torch.bfloat16)  # K = 34: no whole step of 32
    layer = PrepackedLinear(weight, None)
    if panel_gemm_amx_tiles():
        # Not panels, whose vector tiles would take its steps of up to 128 rows on this CPU:
        # oneDNN's (the GEMV needs whole steps of 32 as well).
        assert _PACKED_WEIGHTS[layer.weight_id][3] is None and "decode=onednn" in repr(layer)
    else:
        assert _PACKED_WEIGHTS[layer.weight_id][3] is not None and "decode=panels" in repr(layer)
    x = torch.randn(20, 34, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x).float(), reference(x, None, weight), rtol=1.6e-2, atol=1e-1)


@needs_panel_gemm
def test_panel_gemm_takes_no_rows_and_strided_x():
    torch.manual_seed(0)
    panels = pack_panels(torch.randn(64, 64, dtype=torch.bfloat16))
    assert panel_gemm(torch.zeros(0, 64, dtype=torch.bfloat16), None, panels).shape == (0, 64)
    wide = torch.randn(9, 128, dtype=torch.bfloat16)
    x = wide[:, ::2]  # not contiguous
    assert torch.equal(panel_gemm(x, None, panels), panel_gemm(x.contiguous(), None, panels))


@needs_panel_gemm
@pytest.mark.parametrize("weight, message", [
    (torch.zeros(40, 32, dtype=torch.bfloat16), r"out_features must be a multiple of 32 and in_features of 2, "
                                                r"got \[40, 32\]"),
    (torch.zeros(32, 33, dtype=torch.bfloat16), r"got \[32, 33\]"),
    (torch.zeros(32, 32, dtype=torch.float64), r"the weight must be bf16 or fp32 \[N, K\], got Double"),
    (torch.zeros(32, dtype=torch.bfloat16), r"the weight must be bf16 or fp32 \[N, K\], got BFloat16 \[32\]"),
])
def test_pack_panels_refuses_what_it_cannot_lay_out(weight, message):
    with pytest.raises(RuntimeError, match=message):
        pack_panels(weight)


@needs_panel_gemm
@pytest.mark.parametrize("out", [torch.empty(2, 16, 32, 2), torch.empty(1, 16, 32, 2, dtype=torch.bfloat16),
                                 torch.empty(2, 32, 16, 2, dtype=torch.bfloat16).transpose(1, 2)])
def test_pack_panels_refuses_an_output_of_another_shape_or_dtype(out):
    with pytest.raises(RuntimeError, match=r"out must be contiguous bf16 \[2, 16, 32, 2\]"):
        torch.ops.pdserve_gemv.pack_panels.default(torch.zeros(64, 32, dtype=torch.bfloat16), out)


@needs_panel_gemm
@pytest.mark.parametrize("x, bias, panels, message", [
    (torch.zeros(5, 32), None, None, r"x must be bf16 \[M, K\] for bf16 panels, got Float"),
    (torch.zeros(5, 64, dtype=torch.bfloat16), None, None, "x has 64 columns, the weight 32"),
    (torch.zeros(5, 32, dtype=torch.bfloat16), torch.zeros(64), None, "a contiguous bf16 bias of 64 values expected"),
    (torch.zeros(5, 32, dtype=torch.bfloat16), torch.zeros(63, dtype=torch.bfloat16), None,
     "a contiguous bf16 bias of 64 values expected"),
    (torch.zeros(5, 32, dtype=torch.bfloat16), None, torch.zeros(2, 16, 32, dtype=torch.bfloat16),
     r"the panels must be contiguous bf16 \[N / 32, K / 2, 32, 2\] or fp32 \[N / 16, K, 16\] \(pack_panels\), "
     r"got BFloat16 \[2, 16, 32\]"),
    (torch.zeros(5, 32, dtype=torch.bfloat16), None, torch.zeros(2, 16, 32, 2), "got Float"),
])
def test_panel_gemm_refuses_what_it_cannot_compute(x, bias, panels, message):
    if panels is None:
        panels = pack_panels(torch.zeros(64, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=message):
        panel_gemm(x, bias, panels)


@pytest.mark.parametrize("out_features, in_features", [(16, 1), (32, 33), (96, 96), (960, 576)])
def test_pack_panels_lays_out_an_fp32_weight_in_16_columns(out_features, in_features):
    # The fp32 tiles' op is built wherever the GEMVs are (AVX2 and FMA), whether or not this
    # build's linears take it.
    torch.manual_seed(out_features)
    weight = torch.randn(out_features, in_features)
    panels = pack_panels(weight)
    assert panels.shape == (out_features // 16, in_features, 16) and panels.is_contiguous()
    # panels[p, k, c] == weight[p * 16 + c, k]
    expected = weight.view(out_features // 16, 16, in_features).permute(0, 2, 1)
    assert torch.equal(panels, expected)
    assert torch.equal(pack_panels(weight, huge_pages=True), expected)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 6, 7, 11, 12, 13, 14, 24, 26, 29, 37, 64, 65, 130, 701])
@pytest.mark.parametrize("out_features, in_features", [(16, 1), (48, 96), (96, 96), (576, 1536), (80, 4100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_gemm_over_fp32_panels_matches_fp32_math(num_rows, out_features, in_features, with_bias):
    # Rows off the tiles (6 rows on AVX2, 12 on AVX-512) and both sides of them: 1-2 rows
    # streaming the panels, more asking for the next chunk into L2, tails of 1-11 after whole
    # tiles (on AVX-512 those of 1 and 2 joined to the last whole one: 13, 14, 26, 37, 65); one
    # panel (one thread) to 36, odd runs of panels per thread (AVX-512 tiles span two); K in
    # one chunk, and in two of 2,050 steps (sums carried through y). Past 128 rows each thread
    # takes its own rows in blocks (130: one block a thread; 701 at K = 1,536 or 4,100: many).
    torch.manual_seed(num_rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    x = torch.randn(num_rows, in_features)
    out = panel_gemm(x, bias, pack_panels(weight))
    assert out.shape == (num_rows, out_features) and out.dtype == torch.float32
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # fp32 sums in another order than float64's: a few ulps of the largest terms.
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("in_features", [96, 1536])
def test_fp32_panels_give_a_row_the_same_bits_in_a_prompt_sized_step_as_in_a_decode_step(in_features, num_threads):
    # Past 128 rows each thread takes its own rows, packed block by block where it reads them
    # (panel_gemm_fp32.h's f32_panel_gemm_rows); up to 128 each thread a run of panels against
    # every row, as the native decode loop's region does. A row's sums run in the same order
    # either way, so a prompt's rows get the bits they would get in a decode step.
    torch.manual_seed(in_features)
    weight, bias = torch.randn(80, in_features), torch.randn(80)
    panels = pack_panels(weight)
    x = torch.randn(700, in_features)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = panel_gemm(x, bias, panels)
        for first, num_rows in ((0, 1), (5, 12), (41, 14), (300, 128), (689, 11)):
            assert torch.equal(out[first:first + num_rows], panel_gemm(x[first:first + num_rows], bias, panels))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("x, bias, message", [
    (torch.zeros(5, 32, dtype=torch.bfloat16), None, r"x must be fp32 \[M, K\] for fp32 panels, got BFloat16"),
    (torch.zeros(5, 64), None, "x has 64 columns, the weight 32"),
    (torch.zeros(5, 32), torch.zeros(64, dtype=torch.bfloat16), "a contiguous fp32 bias of 64 values expected"),
    (torch.zeros(5, 32), torch.zeros(63), "a contiguous fp32 bias of 64 values expected"),
])
def test_panel_gemm_over_fp32_panels_refuses_what_it_cannot_compute(x, bias, message):
    with pytest.raises(RuntimeError, match=message):
        panel_gemm(x, bias, pack_panels(torch.zeros(64, 32)))


def test_pack_panels_refuses_an_fp32_weight_or_output_it_cannot_lay_out():
    with pytest.raises(RuntimeError, match=r"an fp32 weight's out_features must be a multiple of 16, got \[40, 32\]"):
        pack_panels(torch.zeros(40, 32))
    for out in (torch.empty(4, 32, 16, dtype=torch.bfloat16), torch.empty(4, 16, 32),
                torch.empty(4, 16, 32).transpose(1, 2)):
        with pytest.raises(RuntimeError, match=r"out must be contiguous fp32 \[4, 32, 16\]"):
            torch.ops.pdserve_gemv.pack_panels.default(torch.zeros(64, 32), out)


def test_fp32_linears_take_panels_up_to_the_rows_the_build_allows():
    # An AVX2 build's tiles stay ahead of oneDNN's AVX2 code up to the scheduler's step;
    # an AVX-512 build's only to 128 rows (kernels/cpu/gemv.cpp's kMaxF32PanelRows). Either
    # way an fp32 linear keeps panels instead of a row-major copy.
    built_for_avx512 = "avx512f" in cpu_flags().split() and not os.environ.get("PDSERVE_CPU_MARCH")
    assert f32_panel_gemm_max_rows() == (128 if built_for_avx512 else 2048)
    layer = PrepackedLinear(torch.randn(96, 64), None)
    assert layer._panels is not None and layer._row_major is None


# An fp32 linear where the library is built for AVX2 (an AVX2-only CPU's own build): panels
# instead of the row-major copy, taking steps of up to 2,048 rows, oneDNN past them, in the
# native op and the Python one alike; the row-major copy with PDSERVE_PANEL_GEMM=0. (The
# native decode loop over fp32 panels: test_native_decode.)
_AVX2_F32_PANELS_SCRIPT = textwrap.dedent("""
    import os
    import torch
    import torch.nn.functional as F
    from common.engine.models.prepacked_linear import PrepackedLinear
    from kernels.cpu_linear import f32_panel_gemm_max_rows, pack_panels, panel_gemm
    assert f32_panel_gemm_max_rows() == 2048
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    layer = PrepackedLinear(weight, bias)
    if os.environ.get("PDSERVE_PANEL_GEMM") == "0":
        assert layer._panels is None and layer._row_major is not None
    else:
        assert layer._row_major is None and layer._panels.shape == (6, 64, 16), layer
        assert "decode=panels, larger=onednn" in repr(layer)
        for num_rows in (1, 4, 5, 64, 2048, 2049):
            x = torch.randn(num_rows, 64)
            out = layer(x)
            assert torch.equal(torch.ops.pdserve.prepacked_linear(x, bias, layer.weight_id_tensor, 96), out)
            onednn = torch.ops.mkldnn._linear_pointwise.default(x, layer._packed, bias, "none", [-1], "")
            assert torch.equal(out, panel_gemm(x, bias, pack_panels(weight)) if num_rows <= 2048 else onednn)
            torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    print("ok")
""")


def test_the_avx2_build_gives_fp32_linears_panels():
    # The same build as the AVX2 GGUF test's (one library for both).
    run_python_ok(_AVX2_F32_PANELS_SCRIPT, timeout_s=120, **avx2_build_environment())
    run_python_ok(_AVX2_F32_PANELS_SCRIPT, timeout_s=120, **avx2_build_environment(), PDSERVE_PANEL_GEMM="0")


@needs_panel_gemm
@pytest.mark.skipif(not prepacking_available(torch.bfloat16), reason="oneDNN cannot pack bf16 here")
@pytest.mark.parametrize("num_tokens", ["one", "the GEMV's most", "the GEMV's most + 1", "most", "past the most"])
def test_a_bf16_linear_takes_panel_gemm_for_decode_steps_and_onednn_beyond(num_tokens):
    # 128 (1,024 on AMD from Zen 5), or 8 on AMX CPUs where panel_gemm may not use the tiles
    max_rows = panel_gemm_max_rows()
    if not os.environ.get("PDSERVE_CPU_MARCH"):  # built for this CPU, not an older target
        assert panel_gemm_amx_built() == ("amx_bf16" in cpu_flags().split())
    assert panel_gemm_amx_tiles() == (panel_gemm_amx_built() and os.environ.get("PDSERVE_AMX_TILES") != "0")
    if panel_gemm_amx_built():
        assert max_rows == (128 if panel_gemm_amx_tiles() else 8)
    else:
        assert max_rows == (1024 if _amd_family() >= 26 else 128)
    num_tokens = {"one": 1, "the GEMV's most": GEMV_MAX_ROWS, "the GEMV's most + 1": GEMV_MAX_ROWS + 1,
                  "most": max_rows, "past the most": max_rows + 1}[num_tokens]
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    layer = PrepackedLinear(weight, bias)
    # It holds the panels and no row-major copy: the weight twice (packed, panels), not three times.
    assert _PACKED_WEIGHTS[layer.weight_id][3] is not None and _PACKED_WEIGHTS[layer.weight_id][2] is None
    assert layer._row_major is None and "decode=panels" in repr(layer)
    x = torch.randn(num_tokens, 64, dtype=torch.bfloat16)
    out = layer(x)
    weight_id = layer.weight_id_tensor
    # The native op and the Python one choose alike.
    assert torch.equal(torch.ops.pdserve.prepacked_linear(x, bias, weight_id, 96), out)
    onednn = torch.ops.mkldnn._linear_pointwise.default(x, layer._packed, bias, "none", [-1], "")
    if num_tokens <= max_rows:
        assert torch.equal(out, panel_gemm(x, bias, pack_panels(weight)))
    else:
        assert torch.equal(out, onednn)
    torch.testing.assert_close(out.float(), reference(x, bias, weight), rtol=1.6e-2, atol=1e-1)


@pytest.mark.parametrize("num_tokens", [1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_linear_takes_the_gemv_for_decode_rows_and_onednn_beyond(num_tokens, dtype, monkeypatch):
    if not prepacking_available(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    # A bf16 weight keeps a row-major copy for the GEMV where it has no panels (no
    # AVX512-BF16, or the panels switched off).
    monkeypatch.setenv("PDSERVE_PANEL_GEMM", "0")
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    layer = PrepackedLinear(weight, bias)
    assert _PACKED_WEIGHTS[layer.weight_id][3] is None and "decode=gemv" in repr(layer)
    assert _PACKED_WEIGHTS[layer.weight_id][2] is not None  # it holds the row-major weight
    x = torch.randn(num_tokens, 64, dtype=dtype)
    out = layer(x)
    if num_tokens <= GEMV_MAX_ROWS:
        assert torch.equal(out, gemv(x, bias, weight))
    tolerance = dict(rtol=1.6e-2, atol=1e-1) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.float(), reference(x, bias, weight), **tolerance)
    # The module owns its weights: changing the source changes nothing.
    weight.zero_()
    assert torch.equal(layer(x), out)


@pytest.mark.skipif(not prepacking_available(torch.bfloat16), reason="oneDNN cannot pack bf16 here")
@pytest.mark.parametrize("num_tokens", [1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_native_linear_op_equals_the_python_op_and_goes_with_its_module(num_tokens, dtype):
    torch.manual_seed(0)
    layer = PrepackedLinear(torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype))
    assert layer._native  # where the library is loaded, the linears take its op
    x = torch.randn(num_tokens, 64, dtype=dtype)
    weight_id = layer.weight_id_tensor  # [] int64, as a compiled graph passes it
    got = native_prepacked_linear(x, layer.bias, weight_id, 96)
    assert torch.equal(got, torch.ops.pdserve.prepacked_linear(x, layer.bias, weight_id, 96))
    assert torch.equal(layer(x), got)
    with pytest.raises(RuntimeError, match="expects 95"):
        native_prepacked_linear(x, layer.bias, weight_id, 95)
    with pytest.raises(ValueError, match="expects 95"):
        torch.ops.pdserve.prepacked_linear(x, layer.bias, weight_id, 95)
    with pytest.raises(RuntimeError, match="0-d int64 CPU tensor"):
        native_prepacked_linear(x, layer.bias, weight_id.int(), 96)
    del layer
    gc.collect()
    with pytest.raises(RuntimeError, match=f"no linear is registered as {int(weight_id)}"):
        native_prepacked_linear(x, None, weight_id, 96)


@needs_panel_gemm
@pytest.mark.skipif(not prepacking_available(torch.bfloat16), reason="oneDNN cannot pack bf16 here")
def test_the_switch_leaves_bf16_linears_without_panels_and_on_onednn(monkeypatch):
    monkeypatch.setenv("PDSERVE_PANEL_GEMM", "0")
    torch.manual_seed(0)
    layer = PrepackedLinear(torch.randn(96, 64, dtype=torch.bfloat16), None)
    assert layer._panels is None and _PACKED_WEIGHTS[layer.weight_id][3] is None
    x = torch.randn(GEMV_MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch.ops.mkldnn._linear_pointwise.default(x, layer._packed, None, "none", [-1], ""))


def _amd_family() -> int:
    """The CPU family of an AMD CPU from /proc/cpuinfo (26: Zen 5); 0 for other vendors."""
    fields = first_cpu_fields()
    return int(fields["cpu family"]) if fields.get("vendor_id") == "AuthenticAMD" else 0


needs_panels_alone = pytest.mark.skipif(not panels_for_any_rows() or not prepacking_available(torch.bfloat16),
                                        reason="panel_gemm does not serve every step here (no AVX512-BF16, or AMX)")


@needs_panels_alone
@pytest.mark.parametrize("num_tokens", [1, GEMV_MAX_ROWS + 1, 128, 129, 300])
def test_a_single_copy_linear_holds_only_its_panels_and_takes_panel_gemm_at_every_size(num_tokens):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    layer = PrepackedLinear(weight, bias, single_copy=True)
    assert layer.single_copy and layer._packed is None and layer._row_major is None
    assert _PACKED_WEIGHTS[layer.weight_id][0] is None and _PACKED_WEIGHTS[layer.weight_id][3] is not None
    assert "decode=panels, larger=panels" in repr(layer)
    x = torch.randn(num_tokens, 64, dtype=torch.bfloat16)
    out = layer(x)
    assert torch.equal(out, panel_gemm(x, bias, pack_panels(weight)))
    weight_id = layer.weight_id_tensor
    assert torch.equal(torch.ops.pdserve.prepacked_linear(x, bias, weight_id, 96), out)  # the Python op alike
    torch.testing.assert_close(out.float(), reference(x, bias, weight), rtol=1.6e-2, atol=1e-1)
    # A panels-only weight serves bf16 rows only, with a clear error, in both ops.
    with pytest.raises(RuntimeError, match="keeps only panels"):
        native_prepacked_linear(x.float(), None, weight_id, 96)
    with pytest.raises(ValueError, match="keeps only panels"):
        torch.ops.pdserve.prepacked_linear(x.float(), None, weight_id, 96)
    # Its slot stays taken while the module lives, and is reused once it is gone.
    assert PrepackedLinear(torch.randn(32, 64, dtype=torch.bfloat16), None).weight_id != layer.weight_id


@needs_panels_alone
def test_a_freed_single_copy_linears_slot_is_reused():
    gc.collect()
    layer = PrepackedLinear(torch.randn(32, 64, dtype=torch.bfloat16), None, single_copy=True)
    weight_id = layer.weight_id
    del layer
    gc.collect()
    assert PrepackedLinear(torch.randn(32, 64, dtype=torch.bfloat16), None).weight_id == weight_id


@pytest.mark.skipif(not prepacking_available(torch.bfloat16), reason="oneDNN cannot pack bf16 here")
def test_a_single_copy_is_kept_only_where_the_panels_serve_every_step(monkeypatch):
    for weight in (torch.randn(96, 64), torch.randn(40, 64, dtype=torch.bfloat16)):  # fp32; no whole panels
        layer = PrepackedLinear(weight, None, single_copy=True)
        assert not layer.single_copy and layer._packed is not None and "larger=onednn" in repr(layer)
    monkeypatch.setenv("PDSERVE_PANEL_GEMM", "0")  # no panels at all: oneDNN's copy stays
    assert not PrepackedLinear(torch.randn(96, 64, dtype=torch.bfloat16), None, single_copy=True).single_copy


def test_a_linear_registered_without_packed_weight_or_panels_is_refused():
    with pytest.raises(RuntimeError, match="needs panels for every step"):
        torch.ops.pdserve_gemv.register_linear(10_000, None, torch.zeros(32, 64), None, None)


def test_odd_widths_stay_on_onednn():
    for dtype in (torch.bfloat16, torch.float32):
        if prepacking_available(dtype):
            odd = PrepackedLinear(torch.randn(16, 40, dtype=dtype), None)
            assert _PACKED_WEIGHTS[odd.weight_id][2] is None  # no whole step of 32 for the GEMV
            # fp32 panels take any in_features (where they run: an AVX2 build); bf16 ones, 16 outputs, none.
            has_panels = dtype == torch.float32 and f32_panel_gemm_max_rows() > 0
            assert (_PACKED_WEIGHTS[odd.weight_id][3] is not None) == has_panels
    if prepacking_available(torch.bfloat16):  # 40 outputs: no whole panels, so no panel copy either
        narrow = PrepackedLinear(torch.randn(40, 64, dtype=torch.bfloat16), None)
        assert _PACKED_WEIGHTS[narrow.weight_id][2] is not None and _PACKED_WEIGHTS[narrow.weight_id][3] is None
        x = torch.randn(GEMV_MAX_ROWS + 1, 64, dtype=torch.bfloat16)
        onednn = torch.ops.mkldnn._linear_pointwise.default(x, narrow._packed, None, "none", [-1], "")
        assert torch.equal(narrow(x), onednn)


@pytest.fixture(scope="module")
def bundled_gguf() -> GGUFQuantizedWeights:
    return GGUFQuantizedWeights(bundled_gguf_path())


@pytest.fixture(scope="module")
def bundled_blocks(bundled_gguf) -> dict[str, Q4_1Blocks]:
    return {name: bundled_gguf.projection(1, name) for name in ("qkv_proj", "down_proj")}


@pytest.fixture(scope="module")
def bundled_head(bundled_gguf) -> Q8_0Blocks:
    return bundled_gguf.head_q8_0()


def q8_0_reference(x, bias, blocks: Q8_0Blocks) -> torch.Tensor:
    """The Q8_0 GEMV's math in float64: d * sum(q x) per block, x block-quantized to int8."""
    n, num_blocks = blocks.d.shape
    xq = block_quantized_x(x).view(x.shape[0], 1, num_blocks, 32)
    out = (blocks.d.double() * (blocks.codes.double() * xq).sum(-1)).sum(-1)  # [M, N]
    return out if bias is None else out + bias.double()


# Rows of x past the decode GEMV's chunks of 4 and past a tile of 64 (the whole head for
# decode rows; its first 1,000 rows beyond, so that the float64 reference stays small).
ROW_COUNTS = [*range(1, GEMV_MAX_ROWS + 1), 5, 7, 8, 13, 64, 65, 130]


def head_rows(head: Q8_0Blocks, num_rows: int) -> Q8_0Blocks:
    if num_rows <= GEMV_MAX_ROWS:
        return head
    return type(head)(**{field.name: getattr(head, field.name)[:1000] for field in fields(head)})


@pytest.mark.parametrize("num_rows", ROW_COUNTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_q8_0_matches_its_math_on_the_head(bundled_head, num_rows, dtype):
    head = head_rows(bundled_head, num_rows)
    torch.manual_seed(num_rows)
    x = torch.randn(num_rows, head.shape[1]).to(dtype)
    bias = torch.randn(head.shape[0]).to(dtype)
    out = q8_0_gemv(x, bias, q8_0_gemv_blocks(head.raw()))
    assert out.shape == (num_rows, head.shape[0]) and out.dtype == dtype
    expected = q8_0_reference(x, bias, head).float()
    scale = expected.abs().max().item()
    if dtype == torch.bfloat16:
        torch.testing.assert_close(out.float(), expected, rtol=2 ** -8, atol=1e-3 * scale)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * scale)


def test_q8_0_stays_close_to_fp32_math(bundled_head):
    # What quantizing x per block costs against fp32 math on the dequantized head: under
    # 1% of the logits' norm.
    torch.manual_seed(3)
    x = torch.randn(GEMV_MAX_ROWS, bundled_head.shape[1])
    out = q8_0_gemv(x, None, q8_0_gemv_blocks(bundled_head.raw()))
    exact = reference(x, None, bundled_head.dequantize(torch.float32))
    assert ((out - exact).norm() / exact.norm()).item() < 1e-2


def test_q8_0_refuses_what_it_cannot_compute(bundled_head):
    raw = q8_0_gemv_blocks(bundled_head.raw()[:64])
    with pytest.raises(RuntimeError, match="columns"):
        q8_0_gemv(torch.zeros(1, 608), None, raw)
    with pytest.raises(RuntimeError, match="x has no rows"):
        q8_0_gemv(torch.zeros(0, 576), None, raw)
    with pytest.raises(RuntimeError, match="uint8"):
        q8_0_gemv(torch.zeros(1, 576), None, raw[:, :-1].contiguous())
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        q8_0_gemv(torch.zeros(1, 576, dtype=torch.half), None, raw)


@pytest.mark.parametrize("num_tokens", [1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, "most", "past the most"])
def test_a_head_with_q8_0_blocks_takes_them_for_decode_rows_and_onednn_beyond(bundled_head, num_tokens):
    # Up to q8_0_max_rows rows (256 with AVX512-VNNI and no AMX tiles, else GEMV_MAX_ROWS).
    most = q8_0_max_rows()
    assert most == 256 or (most == GEMV_MAX_ROWS and ("avx512_vnni" not in cpu_flags() or panel_gemm_amx_tiles()))
    num_tokens = {"most": most, "past the most": most + 1}.get(num_tokens, num_tokens)
    rows = 256  # a slice of the vocabulary keeps the test small
    raw = bundled_head.raw()[:rows].contiguous()
    dense = bundled_head.dequantize(torch.float32)[:rows]
    head = PrepackedLinear(dense, None, q8_0_blocks=raw)
    assert _PACKED_WEIGHTS[head.weight_id][2] is None  # no row-major copy beside the blocks
    x = torch.randn(num_tokens, dense.shape[1])
    out = head(x)
    if num_tokens <= most:  # x quantized per block to int8 (test_q8_0_stays_close_to_fp32_math)
        assert torch.equal(out, q8_0_gemv(x, None, q8_0_gemv_blocks(raw)))
    else:
        torch.testing.assert_close(out, reference(x, None, dense), rtol=1e-5, atol=1e-4)
    # Blocks of another height do not belong to this head: the dense weight serves.
    other = PrepackedLinear(dense, None, q8_0_blocks=raw[:-32])
    assert other._q8_0_blocks is None and (other._row_major is not None or other._panels is not None)
    # The head's own blocks: panels only where they take steps the blocks leave.
    assert (head._panels is not None) == (0 < q8_0_max_rows() < f32_panel_gemm_max_rows())


def block_quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x as the Q4_1 and Q8_0 products see it: per 32 columns, int8 codes
    round(x / s) (half to even) times s = max |x| / 127, in float64."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # the kernel's scale and inverse, in fp32
    scale = amax / 127
    # 127 / amax divided as the kernel divides: torch's scalar / tensor is the reciprocal
    # times 127, an ulp off a quarter of the time, and a rare code then rounds the other way.
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inverse)
    return (codes.double() * scale.double()).reshape(x.shape)


def q4_1_reference(x, bias, blocks: Q4_1Blocks) -> torch.Tensor:
    """The Q4_1 GEMV's math in float64: d * sum(q x) + m * sum(x) per block, x
    block-quantized to int8."""
    n, num_blocks = blocks.d.shape
    codes = blocks.codes().view(n, num_blocks, 32).double()
    xq = block_quantized_x(x)
    xq = xq.view(x.shape[0], 1, num_blocks, 32)
    out = (blocks.d.double() * (codes * xq).sum(-1) + blocks.m.double() * xq.sum(-1)).sum(-1)  # [M, N]
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("num_rows", ROW_COUNTS)
@pytest.mark.parametrize("projection", ["qkv_proj", "down_proj"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_q4_1_matches_its_math_on_the_dequantized_weight(bundled_blocks, num_rows, projection, with_bias, dtype):
    blocks = bundled_blocks[projection]
    out_features, in_features = blocks.shape
    torch.manual_seed(num_rows)
    x = torch.randn(num_rows, in_features, dtype=dtype)
    bias = torch.randn(out_features, dtype=dtype) if with_bias else None
    out = q4_1_gemv(x, bias, q4_1_gemv_blocks(blocks.raw()))
    assert out.shape == (num_rows, out_features) and out.dtype == dtype
    expected = q4_1_reference(x, bias, blocks).float()
    # bf16 output: its rounding; fp32 output: only the order of fp32 sums differs.
    rtol, atol = (2 ** -8, 1e-3) if dtype == torch.bfloat16 else (1e-5, 1e-5)
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol * expected.abs().max().item())


@pytest.mark.parametrize("projection", ["qkv_proj", "down_proj"])
def test_q4_1_stays_close_to_fp32_math(bundled_blocks, projection):
    # What quantizing x per block costs, against fp32 math on the dequantized weight:
    # under 1% of the output's norm (~0.5% for normal x, whose int8 step is ~1/55 of its
    # spread).
    blocks = bundled_blocks[projection]
    torch.manual_seed(7)
    x = torch.randn(GEMV_MAX_ROWS, blocks.shape[1], dtype=torch.bfloat16)
    out = q4_1_gemv(x, None, q4_1_gemv_blocks(blocks.raw())).float()
    exact = reference(x, None, blocks.dequantize(torch.float32))
    assert ((out - exact).norm() / exact.norm()).item() < 1e-2


# Per GGUF format: its GEMV, the layout the GEMV reads, and the GEMV's math in float64.
GGUF_GEMVS = {"q4_1": (q4_1_gemv, q4_1_gemv_blocks, q4_1_reference),
              "q8_0": (q8_0_gemv, q8_0_gemv_blocks, q8_0_reference)}


@pytest.mark.parametrize("gguf_format", GGUF_GEMVS)
@pytest.mark.parametrize("num_rows", [1, GEMV_MAX_ROWS, 70])
@pytest.mark.parametrize("out_features", [1, 5, GGUF_GROUP_ROWS, 37, 3 * GGUF_GROUP_ROWS])
def test_gguf_gemvs_take_any_number_of_rows_of_weight(bundled_blocks, bundled_head, gguf_format, num_rows,
                                                      out_features):
    # Groups of 16 weight rows share a vector; the last group holds what is left.
    gguf_gemv, layout, math = GGUF_GEMVS[gguf_format]
    blocks = bundled_blocks["qkv_proj"] if gguf_format == "q4_1" else bundled_head
    part = type(blocks)(**{field.name: getattr(blocks, field.name)[:out_features] for field in fields(blocks)})
    torch.manual_seed(out_features)
    x = torch.randn(num_rows, part.shape[1])
    out = gguf_gemv(x, None, layout(part.raw()))
    expected = math(x, None, part).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_q4_1_gemv_blocks_rearranges_the_files_bytes(bundled_blocks):
    raw = bundled_blocks["qkv_proj"].raw()[:37]  # two full groups and one of 5 rows
    grouped = q4_1_gemv_blocks(raw)
    assert grouped.shape == raw.shape and grouped.dtype == torch.uint8
    # The same d and m bytes; the nibbles re-paired but the same codes.
    num_blocks = raw.shape[1] // 20
    last_group = grouped[32:].reshape(num_blocks, 20 * 5)  # per block: 80 bytes of codes, 5 d, 5 m
    file_blocks = raw[32:].reshape(5, num_blocks, 20)
    assert torch.equal(last_group[:, 80:90].reshape(num_blocks, 5, 2), file_blocks[..., 0:2].transpose(0, 1))
    assert torch.equal(last_group[:, 90:].reshape(num_blocks, 5, 2), file_blocks[..., 2:4].transpose(0, 1))
    words = last_group[:, :80].reshape(num_blocks, 4, 5, 4)  # [block, unit, row, t]
    codes = torch.stack([words & 0x0F, words >> 4], dim=2)  # [block, unit, low/high, row, t]
    codes = codes.permute(3, 0, 1, 2, 4).reshape(5, num_blocks * 32)  # column 8 unit + 4 high + t
    assert torch.equal(codes, bundled_blocks["qkv_proj"].codes()[32:37])


@pytest.mark.parametrize("num_rows", [1, 3, 20])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_group_gemvs_give_the_same_bits_on_two_threads_as_on_one(bundled_blocks, bundled_head, num_rows, dtype):
    # Each thread takes a run of row groups (and from 16 rows of x a share of its
    # quantization) reading the calling thread's quantized x; the tests run on one thread
    # each otherwise, where any such share is the caller's own.
    head = head_rows(bundled_head, GEMV_MAX_ROWS + 1)  # 1,000 rows: 63 groups
    cases = [(q4_1_gemv, q4_1_gemv_blocks(bundled_blocks["qkv_proj"].raw())),
             (q8_0_gemv, q8_0_gemv_blocks(head.raw()))]
    torch.manual_seed(num_rows)
    previous = torch.get_num_threads()
    try:
        for gemv_op, blocks in cases:
            x = torch.randn(num_rows, blocks.shape[1] // (20 if gemv_op is q4_1_gemv else 34) * 32).to(dtype)
            bias = torch.randn(blocks.shape[0]).to(dtype)
            torch.set_num_threads(1)
            one = gemv_op(x, bias, blocks)
            torch.set_num_threads(2)
            assert torch.equal(gemv_op(x, bias, blocks), one)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("gguf_format", GGUF_GEMVS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_group_gemvs_row_has_the_same_bits_beside_any_rows(bundled_blocks, bundled_head, gguf_format, dtype):
    # A group is read in passes of up to 8 rows of x (AVX-512), then 4, then 1-3: each row
    # must come out the same whichever pass it falls in, and past the 64-row tile, so a
    # request's tokens do not depend on the batch around it.
    gguf_gemv, layout, _ = GGUF_GEMVS[gguf_format]
    blocks = layout((bundled_blocks["qkv_proj"] if gguf_format == "q4_1" else head_rows(bundled_head, 100)).raw())
    in_features = blocks.shape[1] // (20 if gguf_format == "q4_1" else 34) * 32
    torch.manual_seed(3)
    x = torch.randn(75, in_features).to(dtype)
    alone = torch.cat([gguf_gemv(x[i:i + 1], None, blocks) for i in range(x.shape[0])])
    for num_rows in (5, 8, 12, 13, 16, 75):
        assert torch.equal(gguf_gemv(x[:num_rows], None, blocks), alone[:num_rows]), num_rows


def test_q4_1_refuses_what_it_cannot_compute(bundled_blocks):
    blocks = q4_1_gemv_blocks(bundled_blocks["down_proj"].raw())
    in_features = blocks.shape[1] // 20 * 32
    with pytest.raises(RuntimeError, match="columns"):
        q4_1_gemv(torch.zeros(1, in_features + 32, dtype=torch.bfloat16), None, blocks)
    with pytest.raises(RuntimeError, match="x has no rows"):
        q4_1_gemv(torch.zeros(0, in_features, dtype=torch.bfloat16), None, blocks)
    with pytest.raises(RuntimeError, match="uint8"):
        q4_1_gemv(torch.zeros(1, in_features, dtype=torch.bfloat16), None, blocks[:, :-1])
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        q4_1_gemv(torch.zeros(1, in_features, dtype=torch.float16), None, blocks)
    with pytest.raises(RuntimeError, match="bias"):  # the bias in x's dtype
        q4_1_gemv(torch.zeros(1, in_features), torch.zeros(blocks.shape[0], dtype=torch.bfloat16), blocks)


@pytest.mark.skipif(not int4_kernel_available("cpu"), reason="no torch int4 kernel here")
@pytest.mark.parametrize("num_tokens", [1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_q4_1_linear_takes_the_gemv_for_decode_rows_and_torch_int4_beyond(bundled_blocks, num_tokens, dtype):
    blocks = bundled_blocks["qkv_proj"]
    linear = Q4_1Linear(blocks, None, torch.device("cpu"))
    assert linear.blocks is not None
    x = torch.randn(num_tokens, linear.in_features, dtype=dtype)
    out = linear(x)
    assert out.dtype == dtype
    if num_tokens <= GEMV_MAX_ROWS:  # an fp32 model's rows reach the GEMV as they are
        assert torch.equal(out, q4_1_gemv(x, None, q4_1_gemv_blocks(blocks.raw())))
    expected = reference(x, None, blocks.dequantize(torch.float32))
    assert ((out.float() - expected).norm() / expected.norm()).item() < 1e-2
    # torch's int4 kernel takes bf16: fp32 rows are rounded to it and the result widened.
    int4 = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), linear.packed, linear.group_size,
                                                      linear.scales_and_zeros).to(dtype)
    if num_tokens > GEMV_MAX_ROWS:
        assert torch.equal(out, int4)
    # Without the native library (no blocks kept) every step takes torch's kernel.
    linear.blocks = None
    assert torch.equal(linear(x), int4)


def q4_1_widened(blocks: Q4_1Blocks) -> torch.Tensor:
    """[N, K] d q + m exact (float64), as the prompt GEMM widens it before rounding to bf16."""
    codes = blocks.codes().view(blocks.shape[0], -1, 32).double()
    return (blocks.d.double().unsqueeze(-1) * codes + blocks.m.double().unsqueeze(-1)).reshape(blocks.shape)


def assert_bf16_math_on(out: torch.Tensor, x: torch.Tensor, widened: torch.Tensor) -> None:
    """out is fp32 math on bf16 x and the weight rounded once to bf16, the output rounded once
    (torch's int4 kernel, which rounds d and m to bf16 too, misses this for ~0.1% of outputs)."""
    expected = x.float() @ widened.float().bfloat16().float().T
    torch.testing.assert_close(out.float(), expected, rtol=2 ** -8, atol=1e-3 * expected.abs().max().item())


@needs_panel_gemm
@pytest.mark.parametrize("num_tokens", [GEMV_MAX_ROWS + 1, 11, 12, 70, 300])
def test_a_bf16_q4_1_prompt_takes_the_weight_widened_to_bf16_panels(bundled_blocks, num_tokens):
    # From 12 rows (the op's kPromptGemmMinRows) bf16 rows meet the weight widened once per
    # call to bf16 (d q + m in fp32, rounded once) in panel_gemm's products: bit for bit
    # what panel_gemm gives over that weight packed ahead. Fewer rows keep torch's kernel.
    blocks = bundled_blocks["down_proj"]
    linear = Q4_1Linear(blocks, None, torch.device("cpu"))
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, linear.in_features, dtype=torch.bfloat16)
    out = native_q4_1_linear(x, linear.packed, linear.scales_and_zeros, linear.blocks, linear.group_size)
    widened = q4_1_widened(blocks)
    int4 = torch.ops.aten._weight_int4pack_mm_for_cpu(x, linear.packed, linear.group_size, linear.scales_and_zeros)
    if num_tokens >= 12 and panel_gemm_amx_tiles():  # the op's panel_gemm sums on AMX tiles, in another order
        assert_bf16_math_on(out, x, widened)
    elif num_tokens >= 12:
        assert torch.equal(out, panel_gemm(x, None, pack_panels(widened.float().bfloat16())))
    else:
        assert torch.equal(out, int4)
    # Output rows that no whole panel of 32 covers keep torch's kernel at every size.
    part = type(blocks)(**{field.name: getattr(blocks, field.name)[:48] for field in fields(blocks)})
    narrow = Q4_1Linear(part, None, torch.device("cpu"))
    assert torch.equal(native_q4_1_linear(x, narrow.packed, narrow.scales_and_zeros, narrow.blocks, 32),
                       torch.ops.aten._weight_int4pack_mm_for_cpu(x, narrow.packed, 32, narrow.scales_and_zeros))


@pytest.mark.skipif(not gguf_prompt_gemm_available(), reason="the prompt GEMM needs AVX512-BF16 and VNNI")
@pytest.mark.parametrize("num_tokens", [1, GEMV_MAX_ROWS + 1, 11, 12, 70])
def test_a_bf16_models_q4_1_linear_keeps_only_the_blocks(bundled_blocks, num_tokens):
    # No torch int4 copy: decode rows take the GEMV, every larger bf16 step the widened
    # panels (from 5 rows, where a linear with the copy takes them from 12).
    blocks = bundled_blocks["down_proj"]
    lean = Q4_1Linear(blocks, None, torch.device("cpu"), dtype=torch.bfloat16)
    assert lean.packed is None and lean.scales_and_zeros is None and lean.blocks is not None
    assert "blocks only" in lean.extra_repr()
    full = Q4_1Linear(blocks, None, torch.device("cpu"), dtype=torch.float32)
    assert full.packed is not None
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, lean.in_features, dtype=torch.bfloat16)
    out = lean(x)
    if num_tokens <= GEMV_MAX_ROWS:
        assert torch.equal(out, q4_1_gemv(x, None, lean.blocks))
    else:
        assert_bf16_math_on(out, x, q4_1_widened(blocks))
        if num_tokens >= 12:  # past the threshold both take the panels
            assert torch.equal(out, full(x))
    # fp32 rows past the GEMV's would need the int4 copy this linear does not keep.
    if num_tokens > GEMV_MAX_ROWS:
        with pytest.raises(RuntimeError, match="keeps no torch int4 copy"):
            native_q4_1_linear(x.float(), None, None, lean.blocks, 32)


_AVX2_GGUF_SCRIPT = textwrap.dedent("""
    import torch
    from common.engine.model_files import bundled_gguf_path
    from common.engine.models.quantization.gguf_blocks import GGUFQuantizedWeights
    from kernels.cpu_linear import native_gemv_available
    from tests.unit.kernels.test_cpu_linear import GGUF_GEMVS
    assert native_gemv_available() and torch.ops.pdserve_gemv.isa() == "fp32_fma"
    gguf = GGUFQuantizedWeights(bundled_gguf_path())
    blocks, head = gguf.projection(1, "down_proj"), gguf.head_q8_0()
    head.d, head.codes = head.d[:1000], head.codes[:1000]
    torch.manual_seed(0)
    for num_rows in (1, 4, 70):
        for (gemv, layout, reference), weight in ((GGUF_GEMVS["q4_1"], blocks), (GGUF_GEMVS["q8_0"], head)):
            x = torch.randn(num_rows, weight.shape[1])
            out = gemv(x, None, layout(weight.raw()))
            expected = reference(x, None, weight).float()
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    print("ok")
""")


def test_the_avx2_build_of_the_gguf_gemvs_matches_their_math():
    # Machines without AVX512-VNNI take maddubs + madd over two halves of each group:
    # built for x86-64-v3 into the usual kernel cache (the target is part of its key) where
    # this CPU has AVX-512; without it, its own build is that one.
    run_python_ok(_AVX2_GGUF_SCRIPT, timeout_s=280, **avx2_build_environment())


# The kernels that stream their weight (the GGUF row groups, the row-major GEMV) over a
# layer's worth of weights, each output's bytes hashed.
_STREAMED_OUTPUTS_SCRIPT = textwrap.dedent("""
    import hashlib, json
    import torch
    from common.engine.model_files import bundled_gguf_path
    from common.engine.models.quantization.gguf_blocks import GGUFQuantizedWeights
    from kernels.cpu_linear import (gemv, native_gemv_available, q4_1_gemv, q4_1_gemv_blocks, q8_0_gemv,
                                    q8_0_gemv_blocks)
    assert native_gemv_available()  # loads the library
    gguf = GGUFQuantizedWeights(bundled_gguf_path())
    blocks, head = gguf.projection(0, "down_proj"), gguf.head_q8_0()
    head.d, head.codes = head.d[:300], head.codes[:300]
    torch.manual_seed(0)
    dense = torch.randn(300, 576, dtype=torch.bfloat16)
    outputs = {}
    for num_rows in (1, 4, 9):
        x = torch.randn(num_rows, 1536, dtype=torch.bfloat16)
        outputs[f"q4_1/{num_rows}"] = q4_1_gemv(x, None, q4_1_gemv_blocks(blocks.raw()))
        x = torch.randn(num_rows, 576, dtype=torch.bfloat16)
        outputs[f"q8_0/{num_rows}"] = q8_0_gemv(x, None, q8_0_gemv_blocks(head.raw()))
        if num_rows <= 4:  # the row-major GEMV's steps
            outputs[f"bf16/{num_rows}"] = gemv(x, None, dense)
    print(json.dumps({name: hashlib.sha256(out.float().numpy().tobytes()).hexdigest()
                      for name, out in outputs.items()}))
""")


def test_the_stream_prefetch_setting_changes_no_bits():
    # PDSERVE_STREAM_PREFETCH (read once per process: a process each) only says how the
    # weights are asked for ahead; every setting must run and give the default's bits.
    def outputs(**environment):
        done = run_python(_STREAMED_OUTPUTS_SCRIPT, timeout_s=120, **environment)
        return json.loads(done.stdout.strip().splitlines()[-1])
    default = outputs()
    assert len(default) == 8
    for setting in ("nta", "t0", "off"):
        assert outputs(PDSERVE_STREAM_PREFETCH=setting) == default, setting


@pytest.mark.skipif(not int8_kernel_available("cpu"), reason="no torch int8 kernel here")
@pytest.mark.parametrize("num_tokens", [1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_int8_linear_takes_the_q8_0_gemv_for_decode_rows_and_torch_int8_beyond(bundled_blocks, num_tokens,
                                                                                 dtype):
    weight = bundled_blocks["qkv_proj"].dequantize(torch.float32)
    linear = Int8Linear(weight, None)
    assert linear.q8_0_blocks is not None
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, linear.in_features, dtype=dtype)
    out = linear(x)
    assert out.dtype == dtype
    if num_tokens <= GEMV_MAX_ROWS:
        # The Q8_0 GEMV over the codes with each row's scale as d: exactly its math.
        assert torch.equal(out, q8_0_gemv(x, None, linear.q8_0_blocks))
        num_blocks = linear.in_features // 32
        as_q8_0 = Q8_0Blocks(d=linear.scales.half().unsqueeze(1).expand(-1, num_blocks).contiguous(),
                             codes=linear.codes.reshape(-1, num_blocks, 32))
        expected = q8_0_reference(x, None, as_q8_0).float()
        torch.testing.assert_close(out.float(), expected, rtol=2 ** -8 if dtype == torch.bfloat16 else 1e-5,
                                   atol=(1e-3 if dtype == torch.bfloat16 else 1e-5) * expected.abs().max().item())
    else:  # torch's int8 kernel takes bf16
        int8 = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), linear.codes, linear.scales).to(dtype)
        assert torch.equal(out, int8)
    dequantized = linear.codes.float() * linear.scales.float().unsqueeze(1)
    assert ((out.float() - reference(x, None, dequantized)).norm() / reference(x, None, dequantized).norm()) < 1e-2


@needs_panel_gemm
@pytest.mark.skipif(not int8_kernel_available("cpu"), reason="no torch int8 kernel here")
@pytest.mark.parametrize("num_tokens", [GEMV_MAX_ROWS + 1, 11, 12, 70, 300])
@pytest.mark.parametrize("weight_rows", ["bundled", 4096])
def test_a_bf16_int8_prompt_takes_the_weight_widened_to_bf16_panels(bundled_blocks, num_tokens, weight_rows):
    # As for Q4_1: from 12 rows each code times its row's scale (fp32, rounded once to bf16)
    # in panel_gemm's products; fewer rows keep torch's int8 kernel. Both weights are more
    # panels a thread than it widens at a time (256 KB: 2 of K = 1,536).
    if weight_rows == "bundled":
        weight = bundled_blocks["down_proj"].dequantize(torch.float32)
    else:
        weight = torch.randn(weight_rows, 1536, generator=torch.Generator().manual_seed(5)) * 0.05
    linear = Int8Linear(weight, None)
    assert linear.q8_0_blocks is not None
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, linear.in_features, dtype=torch.bfloat16)
    out = linear(x)
    # The scale as the blocks hold it (fp16, exact) times the code: exact in fp32.
    widened = linear.codes.float() * linear.scales.half().float().unsqueeze(1)
    if num_tokens >= 12 and panel_gemm_amx_tiles():  # the op's panel_gemm sums on AMX tiles, in another order
        assert_bf16_math_on(out, x, widened)
    elif num_tokens >= 12:
        assert torch.equal(out, panel_gemm(x, None, pack_panels(widened.bfloat16())))
    else:
        assert torch.equal(out, torch.ops.aten._weight_int8pack_mm(x, linear.codes, linear.scales))


@pytest.mark.skipif(not gguf_prompt_gemm_available(), reason="the prompt GEMM needs AVX512-BF16 and VNNI")
@pytest.mark.parametrize("num_tokens", [1, GEMV_MAX_ROWS + 1, 11, 12, 70])
def test_a_bf16_models_int8_linear_keeps_only_the_blocks(bundled_blocks, num_tokens):
    # A bf16 weight: no second copy of the codes for torch's kernel; decode rows take the
    # Q8_0 GEMV, every larger bf16 step the widened panels (from 5 rows).
    weight = bundled_blocks["down_proj"].dequantize(torch.float32)
    lean, full = Int8Linear(weight.bfloat16(), None), Int8Linear(weight.bfloat16().float(), None)
    assert lean.codes is None and lean.q8_0_blocks is not None and "blocks only" in lean.extra_repr()
    assert full.codes is not None and torch.equal(lean.scales, full.scales)
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, lean.in_features, dtype=torch.bfloat16)
    out = lean(x)
    if num_tokens <= GEMV_MAX_ROWS:
        assert torch.equal(out, q8_0_gemv(x, None, lean.q8_0_blocks))
    else:
        assert_bf16_math_on(out, x, full.codes.float() * full.scales.half().float().unsqueeze(1))
        if num_tokens >= 12:  # past the threshold both take the panels
            assert torch.equal(out, full(x))
        with pytest.raises(RuntimeError, match="keeps no int8 codes"):
            int8_linear(x.float(), None, lean.scales, lean.q8_0_blocks)


@pytest.mark.skipif(not int8_kernel_available("cpu"), reason="no torch int8 kernel here")
def test_int8_scales_that_fp16_cannot_hold_keep_torch_int8():
    weight = torch.randn(64, 96)
    weight[3] *= 1e-9  # its scale underflows fp16
    linear = Int8Linear(weight, None)
    assert linear.q8_0_blocks is None
    x = torch.randn(1, 96, dtype=torch.bfloat16)
    assert torch.equal(linear(x), torch.ops.aten._weight_int8pack_mm(x, linear.codes, linear.scales))
