import textwrap

import pytest
import torch

from common.engine.outputs import ScheduledRequest
from common.engine.sampler import Sampler, _apply_top_k, _apply_top_p
from common.engine.sampling_params import SamplingParams
from tests.support.fresh_process import run_python

EOS = 3


def make_request(req_id="r", prompt=(0,), output=(), **params) -> ScheduledRequest:
    return ScheduledRequest(req_id=req_id, token_ids=[0], start_pos=0, block_table=[], do_sample=True,
                            sampling_params=SamplingParams(**params),
                            prompt_token_ids=list(prompt), output_token_ids=list(output))


def random_logits(num_rows, vocab_size=64, seed=0):
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def draw_counts(logits_row, num_draws, **params):
    """Counts per token of num_draws samples of one logits row (one batch, unseeded rows)."""
    sampler = Sampler(seed=1234)
    requests = [make_request(f"r{i}", **params) for i in range(num_draws)]
    tokens = sampler(logits_row.expand(num_draws, -1), requests).sampled_token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.numel())


def test_greedy_fast_path_is_argmax():
    logits = random_logits(5)
    requests = [make_request(f"r{i}", temperature=0.0) for i in range(5)]
    out = Sampler()(logits, requests)
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None


def test_temperature_zero_is_argmax_in_mixed_batch():
    logits = random_logits(4)
    requests = [make_request("a", temperature=0.0, top_p=0.5, min_p=0.3),
                make_request("b", temperature=1.5), make_request("c", temperature=0.0, logprobs=2),
                make_request("d", temperature=0.7, seed=5)]
    out = Sampler()(logits, requests)
    argmax = logits.argmax(dim=-1).tolist()
    assert out.sampled_token_ids[0] == argmax[0] and out.sampled_token_ids[2] == argmax[2]


def test_top_k_one_equals_greedy():
    logits = random_logits(16)
    requests = [make_request(f"r{i}", temperature=1.3, top_k=1, top_p=0.9, seed=i) for i in range(16)]
    assert Sampler()(logits, requests).sampled_token_ids == logits.argmax(dim=-1).tolist()
    # The random path's top_k mask leaves exactly the argmax too.
    masked = logits.clone()
    _apply_top_k(masked, [1] * 16)
    assert (torch.isfinite(masked).sum(dim=-1) == 1).all()
    assert masked.argmax(dim=-1).tolist() == logits.argmax(dim=-1).tolist()


def test_caller_logits_not_modified():
    logits = random_logits(2)
    before = logits.clone()
    Sampler()(logits, [make_request("a", repetition_penalty=1.5, output=[1, 2], logprobs=1),
                       make_request("b", temperature=0.5, top_k=3, top_p=0.5)])
    assert torch.equal(logits, before)


def run_steps(sampler, logits_per_step, batch_per_step, row_of_target):
    """Sample several steps; return the tokens of the target request (its history grows)."""
    tokens = []
    for logits, batch, row in zip(logits_per_step, batch_per_step, row_of_target):
        batch[row].output_token_ids = list(tokens)
        tokens.append(sampler(logits, batch).sampled_token_ids[row])
    return tokens


def test_seeded_request_independent_of_batch_composition():
    num_steps, vocab_size = 12, 200
    target_logits = random_logits(num_steps, vocab_size, seed=1)  # one row per step
    target_params = dict(seed=4242, temperature=1.0, top_p=0.95)

    alone = run_steps(Sampler(seed=0), [target_logits[s:s + 1] for s in range(num_steps)],
                      [[make_request("t", **target_params)] for _ in range(num_steps)], [0] * num_steps)

    # The same request among other rows with other params, at another row, in another
    # sampler with another engine seed; other rows' logits change every step.
    def crowded_batch(step):
        return [make_request("x", temperature=0.9), make_request("g", temperature=0.0, logprobs=3),
                make_request("p", presence_penalty=1.0, output=[1, 2, 2], top_k=5),
                make_request("t", **target_params), make_request("s", seed=4243, min_p=0.1)]
    crowded_logits = []
    for step in range(num_steps):
        logits = random_logits(5, vocab_size, seed=100 + step)
        logits[3] = target_logits[step]
        crowded_logits.append(logits)
    crowded = run_steps(Sampler(seed=99), crowded_logits, [crowded_batch(s) for s in range(num_steps)],
                        [3] * num_steps)
    assert crowded == alone
    assert len(set(alone)) > 3  # really sampled, not stuck on one token

    other_seed = run_steps(Sampler(seed=0), [target_logits[s:s + 1] for s in range(num_steps)],
                           [[make_request("t", **{**target_params, "seed": 4243})]
                            for _ in range(num_steps)], [0] * num_steps)
    assert other_seed != alone


def test_seeded_request_independent_of_which_sampler_samples_which_position():
    # Disaggregation: prefill samples token 0 on one instance, decode the rest on
    # another (a fresh Sampler); the tokens must equal a single instance's.
    num_steps = 8
    logits = random_logits(num_steps, 300, seed=3)
    params = dict(seed=77, temperature=1.2)
    single = run_steps(Sampler(), [logits[s:s + 1] for s in range(num_steps)],
                       [[make_request("t", **params)] for _ in range(num_steps)], [0] * num_steps)
    first = Sampler(seed=5)(logits[0:1], [make_request("t", **params)]).sampled_token_ids[0]
    decode_sampler, rest = Sampler(seed=6), []
    for step in range(1, num_steps):
        request = make_request("t", output=[first] + rest, **params)
        rest.append(decode_sampler(logits[step:step + 1], [request]).sampled_token_ids[0])
    assert [first] + rest == single


def test_remove_requests_drops_state():
    sampler = Sampler()
    sampler(random_logits(1), [make_request("a", seed=1, repetition_penalty=1.2)])
    assert "a" in sampler._request_generators and "a" in sampler._prompt_id_tensors
    sampler.remove_requests(["a", "never-seen"])
    assert not sampler._request_generators and not sampler._prompt_id_tensors


# Chi-square goodness of fit, 8 categories -> 7 degrees of freedom; at alpha = 0.001
# the critical value is 24.322 (scipy.stats.chi2.ppf(0.999, 7)). Seeds are fixed, so
# the test is deterministic; a correct sampler fails it with probability 0.1%.
CHI2_CRITICAL_DOF7_ALPHA001 = 24.322
PROBS = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])


def chi_square(counts, expected_probs):
    expected = expected_probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_distribution_matches(temperature):
    counts = draw_counts(PROBS.log(), 20_000, temperature=temperature)
    expected = PROBS ** (1 / temperature)  # softmax(log p / T) = p^(1/T) normalised
    assert chi_square(counts.double(), expected / expected.sum()) < CHI2_CRITICAL_DOF7_ALPHA001


def test_empirical_distribution_of_seeded_rows_matches():
    # 10000 requests, seeds 0..9999, each drawing once from its own generator: the
    # per-request streams must be independent of each other for this to pass.
    num_draws = 10_000
    requests = [make_request(f"r{i}", seed=i) for i in range(num_draws)]
    tokens = Sampler()(PROBS.log().expand(num_draws, -1), requests).sampled_token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=8).double()
    assert chi_square(counts, PROBS) < CHI2_CRITICAL_DOF7_ALPHA001


LOGITS_10 = torch.tensor([4.0, 3.5, 3.0, 2.8, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0])


def support(logits_row, top_k=-1, top_p=1.0):
    masked = logits_row.clone().unsqueeze(0)
    _apply_top_k(masked, [top_k])
    _apply_top_p(masked, [top_p])
    return set(torch.isfinite(masked[0]).nonzero().flatten().tolist())


def reference_top_p_support(logits_row, p):
    probs, ids = logits_row.softmax(-1).sort(descending=True)
    mass_above = probs.cumsum(-1) - probs
    return set(ids[mass_above < p].tolist())


def test_truncation_masks_exact_support():
    probs = LOGITS_10.softmax(-1)
    assert support(LOGITS_10, top_k=3) == {0, 1, 2}
    # top_p: keep a token while the mass strictly above it is < p.
    for p in (0.1, 0.4, 0.6, 0.8, 0.95):
        above = torch.cat([torch.zeros(1), probs.cumsum(-1)[:-1]])
        assert support(LOGITS_10, top_p=p) == set((above < p).nonzero().flatten().tolist()), p
    assert support(LOGITS_10, top_k=2, top_p=0.99) == {0, 1}
    assert support(LOGITS_10, top_k=5, top_p=0.5) == {0, 1}


def test_top_p_on_large_vocab_at_every_candidate_tier():
    # Peaked rows are decided from the top 256 candidates, flatter rows need 4096,
    # near-uniform ones the full sort; all must match the plain definition.
    vocab_size = 5000
    logits = torch.cat([random_logits(3, vocab_size, seed=7) * 3,
                        random_logits(2, vocab_size, seed=8) * 0.1,
                        random_logits(1, vocab_size, seed=9) * 0.01])
    top_p = [0.5, 0.9, 1.0, 0.5, 0.2, 0.99]
    assert len(reference_top_p_support(logits[3], 0.5)) > 256
    assert len(reference_top_p_support(logits[5], 0.99)) > 4096
    for rows in ([0, 1, 2], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]):
        masked = logits[rows].clone()
        _apply_top_p(masked, [top_p[i] for i in rows])
        for j, i in enumerate(rows):
            kept = set(torch.isfinite(masked[j]).nonzero().flatten().tolist())
            expected = (set(range(vocab_size)) if top_p[i] == 1.0
                        else reference_top_p_support(logits[i], top_p[i]))
            assert kept == expected, (i, len(kept), len(expected))


@pytest.mark.parametrize("params,expected", [
    (dict(top_k=3), {0, 1, 2}),
    (dict(top_p=0.6), {0, 1}),  # mass above token 1 is .397 < .6; above token 2 .638
    (dict(temperature=0.5, top_p=0.6), {0}),  # temperature first: mass above token 1 is .619
    (dict(min_p=0.2), {0, 1, 2, 3}),
    (dict(top_k=4, min_p=0.35), {0, 1, 2}),
    (dict(top_k=5, top_p=0.7, min_p=0.5), {0, 1}),
])
def test_sampled_tokens_stay_in_support(params, expected):
    counts = draw_counts(LOGITS_10, 4000, **params)
    assert set(counts.nonzero().flatten().tolist()) == expected


def test_penalties_match_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0, 1.0]])
    request = make_request(prompt=[0, 1], output=[2, 2, 4], repetition_penalty=2.0,
                           presence_penalty=0.5, frequency_penalty=0.25, temperature=0.0, logprobs=6)
    # repetition (prompt+output: 0,1,2,4): 2/2, -1*2, 0.5/2, -, 3/2; token 5 unseen.
    # frequency (output counts 2:2, 4:1) and presence (2, 4) on output tokens only.
    expected = torch.tensor([1.0, -2.0, 0.25 - 2 * 0.25 - 0.5, 0.0, 1.5 - 0.25 - 0.5, 1.0])
    out = Sampler()(logits, [request])
    top = dict(zip(out.logprobs[0].top_token_ids, out.logprobs[0].top_logprobs))
    expected_logprobs = torch.log_softmax(expected, -1)
    for token_id in range(6):
        assert top[token_id] == pytest.approx(expected_logprobs[token_id].item(), abs=1e-6)
    assert out.sampled_token_ids == [int(expected.argmax())]


def test_repetition_penalty_below_one_and_unpenalised_row_untouched():
    logits = torch.tensor([[1.0, -1.0, 0.2], [1.0, -1.0, 0.2]])
    requests = [make_request("a", prompt=[0, 1], repetition_penalty=0.5, temperature=0.0, logprobs=3),
                make_request("b", prompt=[0, 1], temperature=0.0, logprobs=3)]
    out = Sampler()(logits, requests)
    penalised = torch.log_softmax(torch.tensor([2.0, -0.5, 0.2]), -1)
    raw = torch.log_softmax(logits[1], -1)
    assert out.logprobs[0].top_logprobs == pytest.approx(penalised.sort(descending=True).values.tolist())
    assert out.logprobs[1].top_logprobs == pytest.approx(raw.sort(descending=True).values.tolist())


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0, 0.0]])  # EOS (3) then stop token 4 lead
    sampler = Sampler(eos_token_ids=[EOS])
    def greedy(output, **params):
        return sampler(logits, [make_request(output=output, temperature=0.0, **params)]).sampled_token_ids[0]
    assert greedy([], min_tokens=2, stop_token_ids=[4]) == 2
    assert greedy([7], min_tokens=2, stop_token_ids=[4]) == 2
    assert greedy([7, 7], min_tokens=2, stop_token_ids=[4]) == EOS
    assert greedy([], min_tokens=2) == 4
    assert greedy([], min_tokens=2, ignore_eos=True, stop_token_ids=[4]) == EOS  # vLLM: not a stop
    # Sampled rows never draw a masked token either.
    counts = torch.zeros(6)
    for seed in range(200):
        token = sampler(logits, [make_request(min_tokens=1, seed=seed, temperature=5.0)]).sampled_token_ids[0]
        counts[token] += 1
    assert counts[EOS] == 0 and counts.sum() == 200


def test_allowed_token_ids_then_logit_bias_then_penalties_in_vllms_order():
    logits = torch.tensor([[2.0, 1.0, 0.0, 5.0]])
    request = make_request(prompt=[2], output=[1], temperature=0.0, allowed_token_ids=[0, 1, 2], logit_bias={1: 2.0},
                           repetition_penalty=2.0, logprobs=3)
    out = Sampler()(logits, [request])
    # Token 3 is not allowed; token 1 is biased to 3.0, then halved as a repeat: [2, 1.5, 0, -inf].
    expected = torch.log_softmax(torch.tensor([2.0, 1.5, 0.0]), -1)
    assert out.sampled_token_ids == [0]
    assert out.logprobs[0].top_token_ids == [0, 1, 2]
    assert out.logprobs[0].top_logprobs == pytest.approx(expected.tolist(), abs=1e-6)
    assert logits.tolist() == [[2.0, 1.0, 0.0, 5.0]]  # the caller's logits are left alone
    # A bias alone moves the argmax; -100 all but bans the leader.
    assert Sampler()(logits, [make_request(temperature=0.0, logit_bias={2: 5.5})]).sampled_token_ids == [2]
    assert Sampler()(logits, [make_request(temperature=0.0, logit_bias={3: -100})]).sampled_token_ids == [0]


def test_random_draws_stay_in_the_allowed_set_and_follow_the_bias():
    logits = random_logits(1, vocab_size=64)[0]
    allowed = [5, 17, 40]
    counts = draw_counts(logits, 600, temperature=3.0, allowed_token_ids=allowed)
    assert counts.sum() == 600 and set(torch.nonzero(counts).flatten().tolist()) == set(allowed)
    # +100 makes one token all but certain; unbiased rows of the same batch are untouched.
    sampler = Sampler(seed=7)
    requests = [make_request(f"b{i}", temperature=1.0, logit_bias={9: 100}) for i in range(50)]
    requests += [make_request(f"u{i}", temperature=1.0) for i in range(50)]
    tokens = sampler(logits.expand(100, -1), requests).sampled_token_ids
    assert tokens[:50] == [9] * 50 and tokens[50:].count(9) < 10


def test_min_tokens_leaves_an_allowed_set_of_stop_tokens_alone():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0, 0.0]])
    sampler = Sampler(eos_token_ids=[EOS])
    def greedy(**params):  # a request id each: the sampler keeps a request's allowed set by its id
        return sampler(logits, [make_request(str(params), temperature=0.0, **params)]).sampled_token_ids[0]
    assert greedy(min_tokens=2, stop_token_ids=[4], allowed_token_ids=[EOS, 4]) == EOS  # else nothing is left
    assert greedy(min_tokens=2, stop_token_ids=[4], allowed_token_ids=[EOS, 4, 5]) == 5
    assert greedy(min_tokens=2, allowed_token_ids=[EOS, 4]) == 4
    assert greedy(stop_token_ids=[4], allowed_token_ids=[EOS, 4, 5]) == EOS


def test_rows_with_a_bias_or_an_allowed_set_are_left_to_the_sampler_and_their_state_dropped():
    sampler = Sampler()
    requests = [make_request("a", temperature=0.0), make_request("b", temperature=0.0, logit_bias={1: 1}),
                make_request("c", temperature=0.7, allowed_token_ids=[1, 2]), make_request("d", temperature=0.7)]
    assert not Sampler.only_argmax(requests[:2])
    in_loop = sampler.rows_in_loop(requests)
    assert in_loop[1:3] == [False, False] and in_loop[0]
    sampler(random_logits(4), requests)
    assert set(sampler._logit_bias_tensors) == {"b"} and set(sampler._allowed_id_tensors) == {"c"}
    sampler.remove_requests(["b", "c"])
    assert not sampler._logit_bias_tensors and not sampler._allowed_id_tensors


def test_bad_words_mask_a_words_last_token_where_the_output_ends_with_the_rest():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0, 7.0]])
    sampler = Sampler()
    def greedy(output, sequences, logprobs=None):
        request = make_request(temperature=0.0, output=output, bad_words_token_ids=sequences, logprobs=logprobs)
        return sampler(logits, [request])
    assert greedy([], [[3]]).sampled_token_ids == [4]  # a one-token word: always masked
    assert greedy([1, 2], [[2, 3]]).sampled_token_ids == [4]  # the output ends with the word's start
    assert greedy([2, 1], [[2, 3]]).sampled_token_ids == [3]  # it does not
    assert greedy([5, 1, 2], [[1, 2, 3], [9, 4]]).sampled_token_ids == [4]
    assert greedy([2], [[1, 2, 3]]).sampled_token_ids == [3]  # too short an output to end with [1, 2]
    assert greedy([1, 2], [[2, 3], [4]]).sampled_token_ids == [5]  # both masked at once
    masked = greedy([2], [[2, 3]], logprobs=1).logprobs[0]
    assert masked.top_token_ids == [4]  # logprobs are of the masked logits, as the draw's
    assert not Sampler.only_argmax([make_request(temperature=0.0, bad_words_token_ids=[[3]])])
    assert sampler.rows_in_loop([make_request(temperature=0.7, bad_words_token_ids=[[3]])]) == [False]
    # random draws never take a masked token
    counts = draw_counts(random_logits(1)[0], 400, temperature=2.0, bad_words_token_ids=[[5], [7]])
    assert counts[5] == counts[7] == 0 and counts.sum() == 400


def test_logprobs_are_log_softmax_before_temperature():
    logits = random_logits(3, vocab_size=50)
    requests = [make_request("a", temperature=0.5, logprobs=5, seed=1), make_request("b"),
                make_request("c", temperature=0.0, logprobs=0)]
    out = Sampler()(logits, requests)
    reference = torch.log_softmax(logits, dim=-1)
    values, ids = reference[0].topk(5)
    lp = out.logprobs[0]
    assert lp.top_token_ids == ids.tolist()
    assert lp.top_logprobs == pytest.approx(values.tolist(), abs=1e-6)
    assert lp.token_logprob == pytest.approx(reference[0, out.sampled_token_ids[0]].item(), abs=1e-6)
    assert out.logprobs[1] is None
    assert out.logprobs[2].top_token_ids == [] and out.logprobs[2].top_logprobs == []
    assert out.logprobs[2].token_logprob == pytest.approx(reference[2].max().item(), abs=1e-6)
    assert Sampler()(logits, [make_request(str(i)) for i in range(3)]).logprobs is None


def test_half_precision_and_empty_batch():
    logits = random_logits(3).to(torch.bfloat16)
    out = Sampler()(logits, [make_request(str(i), top_k=4, logprobs=1) for i in range(3)])
    assert len(out.sampled_token_ids) == 3 and isinstance(out.logprobs[0].token_logprob, float)
    assert Sampler()(torch.zeros(0, 8), []).sampled_token_ids == []


_WARM_UP_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from common.engine.llm import LLM
    from kernels.cpu_sampling import native_argmax_available
    llm = LLM(sys.argv[1], dtype="float32", num_kv_blocks=16, enforce_eager=True)
    # Constructed, no request yet: the native argmax is loaded (built, if need be) already.
    assert native_argmax_available.cache_info().currsize == 1, native_argmax_available.cache_info()
    print("ok", native_argmax_available(), hasattr(torch.ops.pdserve_sampling, "argmax_rows"))
""")


def test_the_engine_loads_the_native_argmax_before_the_first_request(tiny_llama_dir):
    # In a fresh process: here other tests may have loaded it already.
    done = run_python(_WARM_UP_SCRIPT, str(tiny_llama_dir), timeout_s=240, unset=("PDSERVE_CPU_ARGMAX",))
    ok, available, has_op = done.stdout.split()[-3:]
    assert ok == "ok" and has_op == available, done.stdout
