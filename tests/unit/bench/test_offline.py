"""bench offline's check that both engines computed the model: how many greedy tokens of
the single stream they agree on before they first differ."""
from __future__ import annotations

from bench.offline import num_leading_equal


def test_tokens_agree_up_to_the_first_difference():
    assert num_leading_equal([5, 6, 7, 8], [5, 6, 9, 8]) == 2
    assert num_leading_equal([5, 6, 7], [5, 6, 7]) == 3
    assert num_leading_equal([5, 6], [5, 6, 7]) == 2  # the shorter one agrees throughout


def test_an_engine_computing_garbage_agrees_on_none():
    assert num_leading_equal([0] * 16, [339, 3826, 346]) == 0
    assert num_leading_equal([], [1]) == 0
