"""Rejection sampling of draft tokens: exact cases with one-hot targets, and the
guarantee that makes speculative decoding lossless, checked statistically: each
emitted token is distributed as the target's own distribution at its position,
whatever the draft distribution. Trials are rows of one batch, so 200k of them cost
one call."""
from __future__ import annotations

from itertools import chain

import numpy as np
import pytest
import torch

from common.engine.spec_decode.rejection_sampler import (
    num_accepted_point_mass,
    rejection_sample,
)

VOCAB_SIZE = 6
NUM_TRIALS = 200_000
# Expected total variation of 50k-200k draws over 6 tokens is 0.002-0.004; a wrong
# rule (e.g. emitting drafts unchecked) is off by far more than 0.01.
MAX_TOTAL_VARIATION = 0.01


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    # The batches are wide but tiny per row: on a busy machine torch's thread pool
    # costs more than it saves (measured: the module runs in about half the time).
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def one_hot_targets(token_id_rows: list[list[int]]) -> torch.Tensor:
    """[num_reqs, max_k + 1, VOCAB_SIZE] target that emits exactly the given tokens."""
    return torch.nn.functional.one_hot(torch.tensor(token_id_rows), VOCAB_SIZE).float()


def random_distribution(seed: int, *shape: int) -> torch.Tensor:
    """[*shape, VOCAB_SIZE] distributions with every token likely enough to be counted."""
    return torch.softmax(torch.randn(*shape, VOCAB_SIZE, generator=generator(seed)), dim=-1)


def total_variation(token_ids, probs: torch.Tensor) -> float:
    """token_ids: a list or [num_draws] array; probs: [VOCAB_SIZE]"""
    counts = torch.bincount(torch.as_tensor(token_ids), minlength=VOCAB_SIZE).double()
    return 0.5 * float((counts / counts.sum() - probs.double()).abs().sum())


def as_array(emitted: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Emitted rows as ([num_rows, width] right-padded with -1, [num_rows] lengths),
    built without a Python loop per row: 200k rows would dominate the test."""
    lengths = np.fromiter(map(len, emitted), dtype=np.int64, count=len(emitted))  # [num_rows]
    padded = np.full((len(emitted), width), -1, dtype=np.int64)  # [num_rows, width]
    padded[np.arange(width) < lengths[:, None]] = np.fromiter(chain.from_iterable(emitted), dtype=np.int64)
    return padded, lengths


# num_accepted_point_mass


@pytest.mark.parametrize("target_token_ids, draft_token_ids, expected", [
    ([5, 7, 9, 2], [5, 7, 9], 3),  # all accepted: the 2 is the bonus token
    ([5, 8, 9, 2], [5, 7, 9], 1),  # stops at the first mismatch even if later ones agree
    ([4, 7, 9, 2], [5, 7, 9], 0),
    ([3], [], 0),  # no drafts: only the target's own token
])
def test_num_accepted_point_mass_counts_leading_agreement(target_token_ids, draft_token_ids, expected):
    assert num_accepted_point_mass(target_token_ids, draft_token_ids) == expected


@pytest.mark.parametrize("target_token_ids, draft_token_ids", [([1, 2], [1, 2]), ([1, 2, 3], [1]), ([], [])])
def test_num_accepted_point_mass_needs_one_more_target_token_than_drafts(target_token_ids, draft_token_ids):
    with pytest.raises(ValueError, match="one more entry"):
        num_accepted_point_mass(target_token_ids, draft_token_ids)


# rejection_sample: exact cases


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_drafts_equal_to_a_one_hot_target_are_all_accepted_then_the_bonus(with_draft_probs):
    target_probs = one_hot_targets([[3, 1, 4], [0, 5, 2]])  # [2, 3, VOCAB_SIZE]
    draft_probs = random_distribution(1, 2, 2) if with_draft_probs else None
    emitted = rejection_sample(target_probs, torch.tensor([[3, 1], [0, 5]]), [2, 2], draft_probs, generator())
    assert emitted == [[3, 1, 4], [0, 5, 2]]


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_first_mismatch_stops_and_emits_the_target_token_there(with_draft_probs):
    target_probs = one_hot_targets([[3, 1, 4, 2], [0, 5, 2, 1]])  # [2, 4, VOCAB_SIZE]
    draft_token_ids = torch.tensor([[3, 0, 4], [1, 5, 2]])  # row 0 wrong at 1, row 1 at 0
    draft_probs = random_distribution(2, 2, 3) if with_draft_probs else None
    emitted = rejection_sample(target_probs, draft_token_ids, [3, 3], draft_probs, generator())
    assert emitted == [[3, 1], [0]]


def test_rows_use_only_their_own_number_of_drafts():
    # Padding (id -1, NaN target probabilities) past a row's drafts is never read.
    target_probs = one_hot_targets([[2, 0, 0], [3, 4, 0], [1, 2, 5]])  # [3, 3, VOCAB_SIZE]
    target_probs[0, 1:] = float("nan")
    target_probs[1, 2] = float("nan")
    draft_token_ids = torch.tensor([[-1, -1], [3, -1], [1, 2]])
    emitted = rejection_sample(target_probs, draft_token_ids, [0, 1, 2], None, generator())
    assert emitted == [[2], [3, 4], [1, 2, 5]]


def test_no_drafts_at_all_samples_the_first_target_distribution():
    num_trials = NUM_TRIALS // 2
    p0 = random_distribution(3)  # [VOCAB_SIZE]
    target_probs = p0.expand(num_trials, 1, VOCAB_SIZE)  # [num_trials, 1, VOCAB_SIZE]
    emitted = rejection_sample(target_probs, torch.empty(num_trials, 0, dtype=torch.long),
                               [0] * num_trials, None, generator())
    tokens, lengths = as_array(emitted, 1)  # [num_trials, 1], [num_trials]
    assert (lengths == 1).all()
    assert total_variation(tokens[:, 0], p0) < MAX_TOTAL_VARIATION


# rejection_sample: the emitted tokens follow the target distribution


def check_emitted_tokens_follow_target(target_probs, draft_token_ids, draft_probs):
    """target_probs: [NUM_TRIALS, 3, VOCAB_SIZE], the same at every row; two drafts per row."""
    emitted = rejection_sample(target_probs, draft_token_ids, [2] * NUM_TRIALS, draft_probs, generator(7))
    tokens, lengths = as_array(emitted, 3)  # [NUM_TRIALS, 3], [NUM_TRIALS]
    drafts = draft_token_ids.numpy()  # [NUM_TRIALS, 2]
    assert ((lengths >= 1) & (lengths <= 3)).all()
    for j in range(2):
        is_accepted = lengths > j + 1  # [NUM_TRIALS]
        assert (tokens[is_accepted, j] == drafts[is_accepted, j]).all()
        is_recovered = lengths == j + 1  # [NUM_TRIALS]; a recovered token never repeats its draft
        assert (tokens[is_recovered, j] != drafts[is_recovered, j]).all()
    assert total_variation(tokens[:, 0], target_probs[0, 0]) < MAX_TOTAL_VARIATION
    second_tokens = tokens[lengths > 1, 1]  # [num_first_accepted]
    assert len(second_tokens) > NUM_TRIALS // 4
    assert total_variation(second_tokens, target_probs[0, 1]) < MAX_TOTAL_VARIATION
    return lengths


def test_point_mass_drafts_emit_the_target_distribution():
    target_probs = random_distribution(4, 3).expand(NUM_TRIALS, 3, VOCAB_SIZE)  # [NUM_TRIALS, 3, V]
    # Half the rows draft the target's most likely tokens (a greedy draft model that
    # agrees with the target), half draft any token.
    greedy_ids = target_probs[0, :2].argmax(dim=-1).expand(NUM_TRIALS // 2, 2)  # [NUM_TRIALS // 2, 2]
    random_ids = torch.randint(VOCAB_SIZE, (NUM_TRIALS // 2, 2), generator=generator(5))
    draft_token_ids = torch.cat([greedy_ids, random_ids])  # [NUM_TRIALS, 2]
    check_emitted_tokens_follow_target(target_probs, draft_token_ids, None)


def test_random_draft_distributions_emit_the_target_distribution():
    target_probs = random_distribution(4, 3).expand(NUM_TRIALS, 3, VOCAB_SIZE)  # [NUM_TRIALS, 3, V]
    draft_probs = random_distribution(6, NUM_TRIALS, 2)  # [NUM_TRIALS, 2, VOCAB_SIZE], one q per row
    draft_token_ids = torch.multinomial(draft_probs.view(-1, VOCAB_SIZE), 1, generator=generator(8)).view(
        NUM_TRIALS, 2)  # [NUM_TRIALS, 2], drawn from q as a draft model would
    lengths = check_emitted_tokens_follow_target(target_probs, draft_token_ids, draft_probs)
    # Not a degenerate pass: drafts were both accepted and rejected.
    assert set(np.unique(lengths).tolist()) == {1, 2, 3}


def test_bonus_token_follows_the_last_target_distribution():
    num_trials = NUM_TRIALS // 2
    p1 = random_distribution(9)  # [VOCAB_SIZE]
    target_probs = torch.stack([one_hot_targets([[2]])[0, 0], p1]).expand(
        num_trials, 2, VOCAB_SIZE)  # [num_trials, 2, VOCAB_SIZE], draft 2 always accepted
    emitted = rejection_sample(target_probs, torch.full((num_trials, 1), 2), [1] * num_trials, None, generator())
    tokens, lengths = as_array(emitted, 2)  # [num_trials, 2], [num_trials]
    assert (lengths == 2).all() and (tokens[:, 0] == 2).all()
    assert total_variation(tokens[:, 1], p1) < MAX_TOTAL_VARIATION


# rejection_sample: robustness


def corrupt(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, kind: str) -> None:
    """Makes every row's q untrustworthy at position 0 in the given way. draft_probs:
    [num_reqs, max_k, VOCAB_SIZE], mutated."""
    rows = torch.arange(draft_probs.shape[0])
    if kind == "zero_at_draft":
        draft_probs[rows, 0, draft_token_ids[:, 0]] = 0.0
    elif kind == "nan_at_draft":
        draft_probs[rows, 0, draft_token_ids[:, 0]] = float("nan")
    elif kind == "nan_elsewhere":
        draft_probs[rows, 0, (draft_token_ids[:, 0] + 1) % VOCAB_SIZE] = float("nan")
    elif kind == "negative_entry":
        draft_probs[rows, 0, (draft_token_ids[:, 0] + 1) % VOCAB_SIZE] = -0.5
    elif kind == "all_zero":
        draft_probs[:, 0] = 0.0
    elif kind == "inf_entry":
        draft_probs[rows, 0, draft_token_ids[:, 0]] = float("inf")
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["zero_at_draft", "nan_at_draft", "nan_elsewhere", "negative_entry",
                                  "all_zero", "inf_entry"])
def test_untrustworthy_draft_probs_act_as_point_mass_drafts(kind):
    num_trials = NUM_TRIALS // 20
    target_probs = random_distribution(10, 2).expand(num_trials, 2, VOCAB_SIZE)  # [num_trials, 2, V]
    draft_token_ids = torch.randint(VOCAB_SIZE, (num_trials, 1), generator=generator(11))
    draft_probs = random_distribution(12, num_trials, 1)  # [num_trials, 1, VOCAB_SIZE]
    corrupt(draft_probs, draft_token_ids, kind)
    emitted = rejection_sample(target_probs, draft_token_ids, [1] * num_trials, draft_probs, generator())
    point_mass = rejection_sample(target_probs, draft_token_ids, [1] * num_trials, None, generator())
    assert emitted == point_mass
    rejected = [(tokens[0], d) for tokens, d in zip(emitted, draft_token_ids[:, 0].tolist()) if len(tokens) == 1]
    assert rejected and all(token != d for token, d in rejected)


def test_a_rejection_with_no_residual_mass_samples_the_target_without_the_draft():
    # An unnormalised target below q everywhere leaves max(0, p - q) empty.
    target_probs = torch.tensor([[[0.25, 0.25, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1.0]]]).expand(
        1000, 2, VOCAB_SIZE)  # [1000, 2, VOCAB_SIZE]
    draft_probs = torch.tensor([[[0.5, 0.5, 0, 0, 0, 0]]]).expand(1000, 1, VOCAB_SIZE)  # [1000, 1, VOCAB_SIZE]
    emitted = rejection_sample(target_probs, torch.zeros(1000, 1, dtype=torch.long), [1] * 1000, draft_probs,
                               generator())
    assert {tuple(tokens) for tokens in emitted} == {(0, 5), (1,)}


def test_nan_in_target_at_a_verified_position_is_refused():
    target_probs = one_hot_targets([[1, 2, 3]])  # [1, 3, VOCAB_SIZE]
    target_probs[0, 1, 4] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        rejection_sample(target_probs, torch.tensor([[1, 2]]), [2], None, generator())


@pytest.mark.parametrize("draft_token_ids, num_draft_tokens, match", [
    ([[1, 2]], [3], "num_draft_tokens"),
    ([[1, 2]], [-1], "num_draft_tokens"),
    ([[1, 2]], [2, 2], "num_draft_tokens"),
    ([[1, VOCAB_SIZE]], [2], "vocabulary"),
    ([[-1, 2]], [2], "vocabulary"),
    ([[1, 2, 3]], [2], "draft_token_ids must be"),
])
def test_malformed_inputs_are_refused(draft_token_ids, num_draft_tokens, match):
    with pytest.raises(ValueError, match=match):
        rejection_sample(one_hot_targets([[1, 2, 3]]), torch.tensor(draft_token_ids), num_draft_tokens, None,
                         generator())


def test_target_probs_without_a_position_axis_are_refused():
    with pytest.raises(ValueError, match="target_probs must be"):
        rejection_sample(one_hot_targets([[1, 2, 3]])[0], torch.tensor([[1, 2]]), [2], None, generator())


def test_empty_batch_and_batch_without_draft_columns():
    assert rejection_sample(torch.zeros(0, 3, VOCAB_SIZE), torch.zeros(0, 2, dtype=torch.long), [], None,
                            generator()) == []
    # max_k = 0 with (empty) draft distributions: just the target's own token.
    assert rejection_sample(one_hot_targets([[4], [1]]), torch.zeros(2, 0, dtype=torch.int32), [0, 0],
                            torch.zeros(2, 0, VOCAB_SIZE), generator()) == [[4], [1]]


def test_int32_draft_ids_are_accepted():
    emitted = rejection_sample(one_hot_targets([[3, 1, 4]]), torch.tensor([[3, 0]], dtype=torch.int32), [2],
                               None, generator())
    assert emitted == [[3, 1]]


def test_draft_probs_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match="draft_probs must be"):
        rejection_sample(one_hot_targets([[1, 2, 3]]), torch.tensor([[1, 2]]), [2],
                         random_distribution(0, 1, 3), generator())


def test_the_generator_seed_decides_the_output():
    target_probs = random_distribution(13, 1000, 4)  # [1000, 4, VOCAB_SIZE]
    draft_probs = random_distribution(14, 1000, 3)  # [1000, 3, VOCAB_SIZE]
    draft_token_ids = torch.randint(VOCAB_SIZE, (1000, 3), generator=generator(15))
    num_draft_tokens = [i % 4 for i in range(1000)]

    def sample(seed):
        return rejection_sample(target_probs, draft_token_ids, num_draft_tokens, draft_probs, generator(seed))

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
