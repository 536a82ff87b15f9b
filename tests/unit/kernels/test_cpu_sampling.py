"""The native argmax over rows of fp32 or bf16 logits (kernels/cpu/sampling.cpp): torch.argmax's
answer for every row (ties to the first, NaN above every number, infinities, rows of
any length and row stride), clear refusals for what it does not take, and the sampler's
entry point, which leaves every other input to torch. The native draw: the token whose
interval of the float64 softmax CDF holds the uniform number, never a -inf one, the
torch form's token wherever u is not within rounding of an interval's end. The native min_p:
the torch form's threshold. The native top_k: the k largest logits and their ties. The
native top_p: the smallest set of most likely tokens whose mass reaches p, the rest -inf.
The native logprobs: the float64 log-softmax at the taken token and at the row's top tokens
(equal logits by id), within fp32 rounding, and torch's log_softmax on a vocabulary."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.cpu_sampling import argmax_rows, draw_rows, logprobs_rows, native_argmax_available
from tests.support.cpu_targets import avx2_build_environment
from tests.support.fresh_process import run_python, run_python_ok

pytestmark = pytest.mark.skipif(not native_argmax_available(), reason="no C++ compiler: the native argmax is not built")

# A few values, so that ties are common; NaN and the infinities among them.
_values = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, 1e30, -1e30, math.inf, -math.inf, math.nan])


def _logit_rows(max_rows: int, max_len: int, elements, at_least_one_finite: bool = False):
    """[1..max_rows, 1..max_len] float32 logits whose values come from a palette of up to
    32 values drawn from elements (so ties, specials and edge values are common), placed
    by a drawn seed. Drawing every one of up to 2,800 values through hypothesis took ~10x
    as long; the palette keeps what the rows are made of in hypothesis's hands (and
    shrinking), the seed only where each value goes. at_least_one_finite: no row all -inf."""
    def build(shape, palette, seed):
        picks = np.random.default_rng(seed).integers(0, len(palette), size=shape)
        return np.asarray(palette, dtype=np.float32)[picks]

    rows = st.builds(build, st.tuples(st.integers(1, max_rows), st.integers(1, max_len)),
                     st.lists(elements, min_size=1, max_size=32), st.integers(0, 2**32 - 1))
    return rows.filter(lambda a: (a != -np.inf).any(axis=1).all()) if at_least_one_finite else rows


def _rows(width: int):
    """1-5 rows of 1-70 values each: _values or any float of this width."""
    return _logit_rows(5, 70, _values | st.floats(width=width))


@settings(max_examples=300, deadline=None)
@given(_rows(width=32))
def test_matches_torch_argmax(rows):
    logits = torch.from_numpy(rows)  # [num_rows, n]
    assert torch.equal(torch.ops.pdserve_sampling.argmax_rows(logits), logits.argmax(dim=-1))


@settings(max_examples=300, deadline=None)
@given(_rows(width=16))
def test_bf16_rows_have_the_argmax_of_their_fp32_copy(rows):
    # Rounding to bf16 makes ties of values that differed; the first of them wins, as in fp32.
    logits = torch.from_numpy(rows).to(torch.bfloat16)  # [num_rows, n]
    answer = torch.ops.pdserve_sampling.argmax_rows(logits)
    assert torch.equal(answer, logits.float().argmax(dim=-1))
    assert torch.equal(answer, logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 3, 64, 130])
def test_a_vocabulary_sized_row(num_rows, dtype):
    generator = torch.Generator().manual_seed(num_rows)
    logits = torch.randn(num_rows, 49152, generator=generator).to(dtype)
    logits[0, 49151] = 100.0  # the last lane of the last vector
    if num_rows > 2:
        logits[1, 7] = logits[1, 40000] = 100.0  # a tie: the first wins
        logits[2, 49150] = math.nan
        logits[2, 30000] = math.nan  # the first NaN wins over every number
    expected = logits.argmax(dim=-1)
    assert torch.equal(torch.ops.pdserve_sampling.argmax_rows(logits), expected)
    assert expected[0] == 49151


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_apart_in_a_wider_tensor(dtype):
    # A padded head's output sliced to the vocabulary has rows like these.
    wide = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits = wide[::2, 5:250]  # row stride 600, rows contiguous
    assert torch.equal(torch.ops.pdserve_sampling.argmax_rows(logits), logits.argmax(dim=-1))


def test_no_rows():
    assert torch.ops.pdserve_sampling.argmax_rows(torch.empty(0, 10)).shape == (0,)


@pytest.mark.parametrize("logits, message", [
    (torch.zeros(2, 8, dtype=torch.float16), "fp32 or bf16"),
    (torch.zeros(8), "fp32"),
    (torch.zeros(8, 2).t(), "contiguous rows"),
    (torch.zeros(2, 0), "at least one value"),
])
def test_refusals_name_the_problem(logits, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.pdserve_sampling.argmax_rows(logits)


@pytest.mark.parametrize("logits", [
    torch.tensor([[1.0, 3.0, 3.0]], dtype=torch.float16),  # another dtype
    torch.tensor([[1.0, 3.0], [4.0, 0.0]]).t(),  # columns, not rows, contiguous
])
def test_the_entry_point_leaves_the_rest_to_torch(logits):
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def _interval_of(logits_row: torch.Tensor, token_id: int) -> tuple[float, float]:
    """(CDF before token_id, CDF through it) of softmax(logits_row) in float64."""
    cdf = logits_row.double().softmax(dim=-1).cumsum(dim=-1)
    return (0.0 if token_id == 0 else float(cdf[token_id - 1])), float(cdf[token_id])


# Rows of plain numbers and -inf (a truncated token), at least one finite value each.
_draw_rows = _logit_rows(4, 700, st.floats(-30, 30, width=32) | st.just(-math.inf), at_least_one_finite=True)


@settings(max_examples=100, deadline=None)
@given(_draw_rows, st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=4, max_size=4))
def test_draw_takes_the_token_whose_cdf_interval_holds_u(rows, us):
    logits = torch.from_numpy(rows)  # [num_rows, n]
    uniforms = torch.tensor(us[:len(rows)], dtype=torch.float64)  # [num_rows]
    for row, (token_id, u) in enumerate(zip(torch.ops.pdserve_sampling.draw_rows(logits, uniforms).tolist(),
                                            uniforms.tolist())):
        assert logits[row, token_id] != -math.inf
        low, high = _interval_of(logits[row], token_id)
        assert low - 1e-6 <= u <= high + 1e-6, (row, token_id, u, low, high)


def test_draw_over_a_vocabulary_gives_the_torch_forms_tokens():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49152, generator=generator) * 3  # [64, vocab]
    logits[::3, 1000:] = -math.inf  # rows truncated to their first 1,000 tokens
    uniforms = torch.rand(64, dtype=torch.float64, generator=generator)
    native = torch.ops.pdserve_sampling.draw_rows(logits, uniforms)
    assert torch.equal(native, draw_rows(logits.double(), uniforms))  # float64: the torch form
    assert (native[::3] < 1000).all()


def test_draw_at_the_ends_of_the_unit_interval():
    logits = torch.tensor([[-math.inf, 1.0, 2.0, -math.inf, 0.5, -math.inf]] * 3)
    uniforms = torch.tensor([0.0, 1.0 - 2 ** -53, 0.5], dtype=torch.float64)
    native = torch.ops.pdserve_sampling.draw_rows(logits, uniforms).tolist()
    assert native[:2] == [1, 4]  # the first and the last token with a weight
    assert native == draw_rows(logits.double(), uniforms).tolist()


def test_draw_rows_with_one_token_or_none_to_draw():
    logits = torch.tensor([[-math.inf, -math.inf, 7.0, -math.inf],  # truncated to one token
                           [-math.inf] * 4,  # nothing left: the first largest, as argmax
                           [0.0, math.nan, 1.0, math.nan],  # no distribution: the first NaN
                           [0.0, math.inf, 1.0, 2.0]])
    uniforms = torch.full((4,), 0.999, dtype=torch.float64)
    assert torch.ops.pdserve_sampling.draw_rows(logits, uniforms).tolist() == [2, 0, 1, 1]


def test_draw_of_rows_apart_in_a_wider_tensor():
    wide = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    logits = wide[::2, 5:250]  # row stride 600, rows contiguous
    uniforms = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    assert torch.equal(torch.ops.pdserve_sampling.draw_rows(logits, uniforms), draw_rows(logits.double(), uniforms))


@pytest.mark.parametrize("logits, uniforms, message", [
    (torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float64), "fp32"),
    (torch.zeros(8, 2).t(), torch.zeros(2, dtype=torch.float64), "contiguous rows"),
    (torch.zeros(2, 0), torch.zeros(2, dtype=torch.float64), "at least one value"),
    (torch.zeros(2, 8), torch.zeros(2), "float64"),
    (torch.zeros(2, 8), torch.zeros(3, dtype=torch.float64), r"\[num_rows\] uniforms"),
])
def test_draw_refusals_name_the_problem(logits, uniforms, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.pdserve_sampling.draw_rows(logits, uniforms)


@settings(max_examples=100, deadline=None)
@given(_draw_rows, st.lists(st.sampled_from([0.0, 1e-9, 0.05, 0.5, 1.0]) | st.floats(0.0, 1.0), min_size=4,
                            max_size=4))
def test_min_p_masks_what_the_torch_form_masks(rows, ps):
    logits = torch.from_numpy(rows)  # [num_rows, n]
    min_p = torch.tensor(ps[:len(rows)])  # [num_rows]
    masked = logits.clone()
    torch.ops.pdserve_sampling.min_p_mask_rows_(masked, min_p)
    expected = logits.masked_fill(logits < logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1), -math.inf)
    assert torch.equal(masked, expected)


def test_min_p_refusals_name_the_problem():
    with pytest.raises(ValueError, match=r"fp32 \[num_rows\] min_p"):
        torch.ops.pdserve_sampling.min_p_mask_rows_(torch.zeros(2, 8), torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous rows"):
        torch.ops.pdserve_sampling.min_p_mask_rows_(torch.zeros(8, 2).t(), torch.ones(2))


def _top_k_reference(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    out = logits.clone()
    for row, k in enumerate(top_k):
        if 0 < k < logits.shape[1]:
            kth = logits[row].topk(k).values[-1]
            out[row][logits[row] < kth] = -math.inf
    return out


# Few distinct values among many, so that ties with the k-th are common.
_top_k_rows = _logit_rows(4, 600, st.sampled_from([-math.inf, -40.0, -17.0, -3.0, 0.0, 0.01, 2.0])
                          | st.floats(-40, 40, width=32), at_least_one_finite=True)


@settings(max_examples=150, deadline=None)
@given(_top_k_rows, st.lists(st.integers(-1, 700), min_size=4, max_size=4))
def test_top_k_keeps_the_k_largest_and_their_ties(rows, ks):
    logits = torch.from_numpy(rows)  # [num_rows, n]
    top_k = ks[:len(rows)]
    masked = logits.clone()
    torch.ops.pdserve_sampling.top_k_mask_rows_(masked, torch.tensor(top_k))
    assert torch.equal(masked, _top_k_reference(logits, top_k))


@pytest.mark.parametrize("scale", [1.0, 8.0, 0.01])
def test_top_k_over_a_vocabulary(scale):
    logits = torch.randn(5, 49152, generator=torch.Generator().manual_seed(3)) * scale  # [5, vocab]
    logits[4, 100:] = -math.inf
    top_k = [1, 50, 20000, 49152, 1000]  # the last two rows left whole
    masked = logits.clone()
    torch.ops.pdserve_sampling.top_k_mask_rows_(masked, torch.tensor(top_k))
    assert torch.equal(masked, _top_k_reference(logits, top_k))
    assert [int(torch.isfinite(row).sum()) for row in masked] == [1, 50, 20000, 49152, 100]


@pytest.mark.parametrize("k", [1, 12, 50, 3000, 5000, 49000])
def test_top_k_beyond_the_tokens_near_the_top(k):
    # A peaked row: 10 tokens near its top, the k-th far below them (the heap up to 4,096
    # ranks, selection over the far tokens past that), some of them -inf.
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(k))  # [3, vocab]
    logits[:, 100:110] = 60.0 + torch.arange(10.0)
    logits[1, 40000:] = -math.inf  # row 1: fewer finite tokens than the largest k
    logits[2, ::7] = 1.5  # row 2: many ties
    masked = logits.clone()
    torch.ops.pdserve_sampling.top_k_mask_rows_(masked, torch.full((3,), k))
    assert torch.equal(masked, _top_k_reference(logits, [k] * 3))


@pytest.mark.parametrize("logits, top_k, message", [
    (torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(2, dtype=torch.long), "fp32"),
    (torch.zeros(2, 8), torch.ones(2), r"int64 \[num_rows\] top_k"),
])
def test_top_k_refusals_name_the_problem(logits, top_k, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.pdserve_sampling.top_k_mask_rows_(logits, top_k)


def _top_p_reference(row: torch.Tensor, p: float) -> set[int]:
    """Tokens whose mass ranked above them (float64, ties by column) is < p."""
    probs = row.double().softmax(dim=-1)
    order = sorted(range(row.shape[0]), key=lambda i: (-float(probs[i]), i))
    kept, above = set(), 0.0
    for i in order:
        if above < p and row[i] != -math.inf:
            kept.add(i)
        above += float(probs[i])
    return kept


@settings(max_examples=150, deadline=None)
@given(_draw_rows, st.lists(st.floats(0.01, 0.999), min_size=4, max_size=4))
def test_top_p_keeps_the_most_likely_tokens_until_their_mass_reaches_p(rows, ps):
    logits = torch.from_numpy(rows)  # [num_rows, n]
    masked = logits.clone()
    torch.ops.pdserve_sampling.top_p_mask_rows_(masked, torch.tensor(ps[:len(rows)]))
    for row, p in enumerate(ps[:len(rows)]):
        kept = torch.isfinite(masked[row])
        assert torch.equal(masked[row][kept], logits[row][kept])  # kept values untouched
        probs = logits[row].double().softmax(dim=-1)
        assert kept[logits[row].argmax()]  # the top token stays
        smallest_kept = float(logits[row][kept].min())
        assert not (logits[row][~kept] > smallest_kept).any()  # a prefix of the ranking
        kept_mass = float(probs[kept].sum())
        last = probs[kept & (logits[row] == smallest_kept)]
        assert kept_mass - float(last.sum()) < p + 1e-6  # no more tokens than needed...
        assert kept_mass >= p - 1e-6 or bool(kept[logits[row] != -math.inf].all())  # ...and enough


@pytest.mark.parametrize("scale", [1.0, 4.0, 0.05])  # peaked to nearly flat
def test_top_p_over_a_vocabulary_keeps_the_reference_set(scale):
    generator = torch.Generator().manual_seed(int(scale * 100))
    logits = torch.randn(4, 49152, generator=generator) * scale  # [4, vocab]
    logits[1, 20000:] = -math.inf
    top_p = [0.5, 0.9, 1.0, 0.99]
    masked = logits.clone()
    torch.ops.pdserve_sampling.top_p_mask_rows_(masked, torch.tensor(top_p))
    assert torch.equal(masked[2], logits[2])  # p = 1 leaves the row whole
    for row in (0, 1, 3):
        kept = set(torch.isfinite(masked[row]).nonzero().flatten().tolist())
        assert kept == _top_p_reference(logits[row], top_p[row]), row


@pytest.mark.parametrize("spread, peak, p", [(0.3, 17.0, 0.999), (0.3, 17.0, 0.99999), (3.0, 30.5, 0.9999999)])
def test_top_p_crossing_among_the_far_tokens_keeps_the_tokens_the_definition_does(spread, peak, p):
    """A peaked row whose mass reaches p only among the tokens 16+ nats below its top (the far
    bucket, ranked again in finer buckets; the far tokens close together, or spread over many
    nats): every token with less than p - 1e-6 of the mass ranked above it stays, every one
    with more than p + 1e-6 goes (within the float32 weights' rounding of the definition)."""
    generator = torch.Generator().manual_seed(int(spread * 10))
    logits = torch.randn(2, 49152, generator=generator) * spread  # [2, vocab]
    logits[:, 5] = peak
    logits[1, 30000:] = -math.inf
    masked = logits.clone()
    torch.ops.pdserve_sampling.top_p_mask_rows_(masked, torch.full((2,), p))
    p = float(torch.tensor(p))  # the op's float32 p
    for row in range(2):
        probs = logits[row].double().softmax(dim=-1)
        order = torch.argsort(logits[row], descending=True, stable=True)  # ties by column
        mass_above = torch.zeros_like(probs)
        mass_above[order] = probs[order].cumsum(0) - probs[order]
        kept = torch.isfinite(masked[row])
        finite = torch.isfinite(logits[row])
        assert kept[finite & (mass_above < p - 1e-6)].all() and not kept[mass_above > p + 1e-6].any(), row
    # the first row's mass crosses p among the far tokens
    assert float(logits[0][torch.isfinite(masked[0])].min()) < peak - 16


@pytest.mark.parametrize("logits, top_p, message", [
    (torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(2), "fp32"),
    (torch.zeros(8, 2).t(), torch.ones(2), "contiguous rows"),
    (torch.zeros(2, 8), torch.ones(2, dtype=torch.float64), r"fp32 \[num_rows\] top_p"),
    (torch.zeros(2, 8), torch.ones(3), r"fp32 \[num_rows\] top_p"),
])
def test_top_p_refusals_name_the_problem(logits, top_p, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.pdserve_sampling.top_p_mask_rows_(logits, top_p)


def _logprobs_reference(row: torch.Tensor, token_id: int, num_top: int) -> tuple[list[float], list[int]]:
    """The definition in float64: log_softmax(row) at token_id, then at the num_top largest
    logits, most likely first, equal logits by id."""
    logprobs = row.double().log_softmax(dim=-1)
    order = sorted(range(row.shape[0]), key=lambda i: (-row[i].item(), i))[:num_top]
    return [logprobs[token_id].item()] + [logprobs[i].item() for i in order], order


# Few distinct values among many, so that ties at the top are common; some rows with -inf.
_logprob_rows = _logit_rows(4, 300, st.sampled_from([-math.inf, -30.0, -3.0, 0.0, 0.5, 2.0])
                            | st.floats(-60, 60, width=32), at_least_one_finite=True)


@settings(max_examples=150, deadline=None)
@given(_logprob_rows, st.integers(0, 20), st.data())
def test_logprobs_are_the_log_softmax_at_the_token_and_the_top_tokens(rows, num_top, data):
    logits = torch.from_numpy(rows)  # [num_rows, n]
    num_rows, n = logits.shape
    num_top = min(num_top, n)
    token_ids = [data.draw(st.integers(0, n - 1)) for _ in range(num_rows)]
    values, top_ids = torch.ops.pdserve_sampling.logprobs_rows(logits, torch.tensor(token_ids), num_top)
    assert values.shape == (num_rows, 1 + num_top) and top_ids.shape == (num_rows, num_top)
    for r in range(num_rows):
        want_values, want_ids = _logprobs_reference(logits[r], token_ids[r], num_top)
        assert top_ids[r].tolist() == want_ids
        assert values[r].tolist() == pytest.approx(want_values, abs=1e-5, rel=1e-6)


@pytest.mark.parametrize("num_top", [0, 1, 20])
def test_logprobs_over_a_vocabulary_match_torch(num_top):
    generator = torch.Generator().manual_seed(num_top)
    logits = torch.randn(5, 49152, generator=generator) * 3  # [5, vocab]
    logits[1, 40000] = 30.0  # a peaked row, its top token late in the row
    logits[2] = logits[2].bfloat16().float()  # bf16 values: ties among the top ones
    token_ids = torch.tensor([0, 40000, 17, 49151, 123])
    values, top_ids = torch.ops.pdserve_sampling.logprobs_rows(logits, token_ids, num_top)
    want = logits.log_softmax(dim=-1)
    torch.testing.assert_close(values[:, 0], want.gather(1, token_ids.view(-1, 1)).squeeze(1), atol=2e-5, rtol=0)
    top = want.topk(num_top, dim=-1)
    torch.testing.assert_close(values[:, 1:], top.values, atol=2e-5, rtol=0)
    torch.testing.assert_close(want.gather(1, top_ids), top.values, atol=0, rtol=0)  # tied ids differ at most
    if num_top:
        assert top_ids[1, 0] == 40000
    # The entry point gives the same.
    assert all(torch.equal(a, b) for a, b in zip(logprobs_rows(logits, token_ids, num_top), (values, top_ids)))


def test_logprobs_of_rows_with_no_distribution_are_nan():
    logits = torch.tensor([[0.0, math.nan, 1.0], [-math.inf] * 3, [1.0, math.inf, 0.0], [0.0, -math.inf, 1.0]])
    values, top_ids = torch.ops.pdserve_sampling.logprobs_rows(logits, torch.tensor([0, 1, 2, 1]), 3)
    assert values[:3].isnan().all()
    assert values[3].tolist() == pytest.approx([-math.inf, math.log(1 / (1 + math.e)) + 1,
                                                math.log(1 / (1 + math.e)), -math.inf])
    assert top_ids[3].tolist() == [2, 0, 1]


@pytest.mark.parametrize("logits, token_ids, num_top, message", [
    (torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64), 1, "fp32"),
    (torch.zeros(8, 2).t(), torch.zeros(2, dtype=torch.int64), 1, "contiguous rows"),
    (torch.zeros(2, 8), torch.zeros(2, dtype=torch.int32), 1, r"int64 \[num_rows\] token_ids"),
    (torch.zeros(2, 8), torch.zeros(3, dtype=torch.int64), 1, r"int64 \[num_rows\] token_ids"),
    (torch.zeros(2, 8), torch.tensor([0, 8]), 1, "token id 8 of row 1 is outside"),
    (torch.zeros(2, 8), torch.tensor([0, -1]), 1, "token id -1 of row 1 is outside"),
    (torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), 9, r"num_top must be in \[0, 8\]"),
    (torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), -1, r"num_top must be in \[0, 8\]"),
])
def test_logprobs_refusals_name_the_problem(logits, token_ids, num_top, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.pdserve_sampling.logprobs_rows(logits, token_ids, num_top)


def test_the_switch_turns_it_off():
    done = run_python("from kernels.cpu_sampling import native_argmax_available as a; print(a())", timeout_s=120,
                      PDSERVE_CPU_ARGMAX="0")
    assert done.stdout.strip().splitlines()[-1] == "False"


_OTHER_BUILD_SCRIPT = """
import math, torch
from kernels.cpu_sampling import native_argmax_available
assert native_argmax_available()
generator = torch.Generator().manual_seed(0)
cases = [torch.randn(5, n, generator=generator) for n in (1, 7, 8, 9, 16, 17, 49152)]
tied = torch.zeros(2, 40)
tied[0, 3] = tied[0, 30] = 1.0
tied[1, 39] = math.nan
tied[1, 20] = math.inf
cases.append(tied)
for logits in cases + [case.to(torch.bfloat16) for case in cases]:
    assert torch.equal(torch.ops.pdserve_sampling.argmax_rows(logits), logits.argmax(dim=-1)), logits.shape
for logits in cases[:-1]:
    logits[::2, 3:] = -math.inf
    uniforms = torch.rand(logits.shape[0], dtype=torch.float64, generator=generator)
    drawn = torch.ops.pdserve_sampling.draw_rows(logits, uniforms)
    cdf = logits.double().softmax(dim=-1).cumsum(dim=-1)
    for row, token_id in enumerate(drawn.tolist()):
        low = 0.0 if token_id == 0 else float(cdf[row, token_id - 1])
        assert low - 1e-6 <= float(uniforms[row]) <= float(cdf[row, token_id]) + 1e-6, (logits.shape, row)
        assert logits[row, token_id] != -math.inf
    masked = logits.clone()
    torch.ops.pdserve_sampling.top_k_mask_rows_(masked, torch.full((logits.shape[0],), 3, dtype=torch.long))
    for row in range(logits.shape[0]):
        if logits.shape[1] > 3:
            assert torch.equal(masked[row] == -math.inf, logits[row] < logits[row].topk(3).values[-1]), row
    masked = logits.clone()
    torch.ops.pdserve_sampling.top_p_mask_rows_(masked, torch.full((logits.shape[0],), 0.8))
    for row in range(logits.shape[0]):
        probs = logits[row].double().softmax(dim=-1)
        kept = torch.isfinite(masked[row])
        smallest_kept = float(logits[row][kept].min())
        assert not (logits[row][~kept] > smallest_kept).any()
        kept_mass = float(probs[kept].sum())
        last_mass = float(probs[kept & (logits[row] == smallest_kept)].sum())
        assert kept_mass - last_mass < 0.8 + 1e-6 and (kept_mass >= 0.8 - 1e-6 or bool(kept.all())), row
print("ok")
"""


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_the_avx2_and_baseline_builds_answer_as_torch(march):
    # Other CPUs get 8-lane vectors (AVX2's movemask, or no intrinsics at all): built here
    # for those targets into the usual kernel cache (the target is part of its key); an
    # AVX2-only CPU's own build is the AVX2 one.
    environment = avx2_build_environment() if march == "x86-64-v3" else {"PDSERVE_CPU_MARCH": march}
    run_python_ok(_OTHER_BUILD_SCRIPT, timeout_s=280, **environment)
