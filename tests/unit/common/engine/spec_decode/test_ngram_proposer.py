"""Prompt-lookup drafting: hand cases for each rule (longest n first, most recent
occurrence, truncation at the history's end), batching that changes nothing, and a
property test against a direct reference implementation."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.engine.spec_decode.ngram_proposer import NgramProposer
from tests.support.properties import BOUNDED


def reference_propose(history: list[int], num_speculative_tokens: int, prompt_lookup_min: int,
                      prompt_lookup_max: int) -> list[int]:
    """The rule written out directly: longest suffix first, then the latest earlier start."""
    for n in range(prompt_lookup_max, prompt_lookup_min - 1, -1):
        if len(history) < n + 1:
            continue
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                return history[start + n:start + n + num_speculative_tokens]
    return []


def test_repeated_phrase_proposes_its_continuation():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    history = [7, 1, 2, 3, 4, 5, 6, 9, 1, 2, 3]
    assert proposer.propose([history]) == [[4, 5, 6]]


def test_longest_match_wins_over_a_more_recent_shorter_one():
    proposer = NgramProposer(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3)
    # [1, 2, 3] occurs at 0 (then 10, 11); only [2, 3] / [3] occur later (then 20 / 30).
    history = [1, 2, 3, 10, 11, 8, 2, 3, 20, 3, 30, 1, 2, 3]
    assert proposer.propose([history]) == [[10, 11]]


def test_most_recent_occurrence_wins_among_equal_lengths():
    proposer = NgramProposer(num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=2)
    history = [4, 5, 10, 11, 4, 5, 20, 21, 4, 5]
    assert proposer.propose([history]) == [[20, 21]]


def test_match_overlapping_the_suffix_counts():
    proposer = NgramProposer(num_speculative_tokens=5, prompt_lookup_min=2, prompt_lookup_max=4)
    # The suffix [1, 2, 1, 2] last occurred earlier at 2, overlapping it.
    assert proposer.propose([[9, 9, 1, 2, 1, 2, 1, 2]]) == [[1, 2]]


def test_proposal_is_cut_at_the_end_of_the_history():
    proposer = NgramProposer(num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=2)
    assert proposer.propose([[3, 4, 8, 3, 4]]) == [[8, 3, 4]]


@pytest.mark.parametrize("history", [[], [5], [1, 2, 3, 4], [1, 2, 3, 1, 2, 4]])
def test_no_earlier_occurrence_proposes_nothing(history):
    # The last case: [2, 4] and [4] never occurred before; [1, 2] did but is not a suffix.
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    assert proposer.propose([history]) == [[]]


def test_suffix_shorter_than_prompt_lookup_min_is_not_matched():
    # [3] recurs, but prompt_lookup_min = 2 and [5, 3] never occurred before.
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    assert proposer.propose([[3, 7, 8, 5, 3]]) == [[]]
    assert NgramProposer(3, 1, 3).propose([[3, 7, 8, 5, 3]]) == [[7, 8, 5]]


def test_batch_of_mixed_rows_matches_each_row_alone():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=4)
    histories = [
        [7, 1, 2, 3, 4, 5, 6, 9, 1, 2, 3],
        [],
        [1, 2, 3, 10, 11, 8, 2, 3, 20, 3, 30, 1, 2, 3],
        [5],
        [1, 2, 3, 4],
        [9, 9, 1, 2, 1, 2, 1, 2] * 20,  # much longer than the rest: most rows are padding
        [3, 4, 8, 3, 4],
    ]
    alone = [proposer.propose([history])[0] for history in histories]
    assert proposer.propose(histories) == alone
    assert alone == [[4, 5, 6], [], [10, 11, 8], [], [], [1, 2], [8, 3, 4]]


def test_empty_batch_proposes_nothing():
    assert NgramProposer(3, 1, 3).propose([]) == []


@pytest.mark.parametrize("num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, match", [
    (0, 1, 3, "num_speculative_tokens"),
    (3, 0, 3, "prompt_lookup_min"),
    (3, 4, 3, "prompt_lookup_min <= prompt_lookup_max"),
    (3, -2, -1, "prompt_lookup_min"),
])
def test_invalid_settings_are_refused(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, match):
    with pytest.raises(ValueError, match=match):
        NgramProposer(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)


@BOUNDED
@given(histories=st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=6),
       num_speculative_tokens=st.integers(1, 6), prompt_lookup_min=st.integers(1, 4),
       extra_lookup=st.integers(0, 3))
def test_batch_proposals_match_the_reference(histories, num_speculative_tokens, prompt_lookup_min,
                                             extra_lookup):
    prompt_lookup_max = prompt_lookup_min + extra_lookup
    proposer = NgramProposer(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)
    expected = [reference_propose(history, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)
                for history in histories]
    assert proposer.propose(histories) == expected
