"""Scores from embeddings (common.engine.scoring): vLLM's pairing rules and torch's cosine
similarity, in plain Python. LLM.score on a model: test_pooling.py."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from common.engine.scoring import cosine_similarity, score_pairs

finite = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, width=32)
vectors = st.integers(1, 64).flatmap(lambda n: st.tuples(st.lists(finite, min_size=n, max_size=n),
                                                         st.lists(finite, min_size=n, max_size=n)))


def test_pairs_are_one_to_one_one_to_many_or_pairwise():
    assert score_pairs(1, 1) == [(0, 0)]
    assert score_pairs(1, 3) == [(0, 0), (0, 1), (0, 2)]
    assert score_pairs(3, 3) == [(0, 0), (1, 1), (2, 2)]
    for num_queries, num_documents, match in ((2, 3, "1:1, 1:N or N:N"), (3, 1, "1:1, 1:N or N:N"),
                                              (0, 2, "at least one query"), (1, 0, "at least one document")):
        with pytest.raises(ValueError, match=match):
            score_pairs(num_queries, num_documents)


@given(vectors)
def test_cosine_similarity_is_torchs(pair):
    a, b = pair
    want = torch.nn.functional.cosine_similarity(torch.tensor(a, dtype=torch.float64),
                                                 torch.tensor(b, dtype=torch.float64), dim=0).item()
    got = cosine_similarity(a, b)
    assert got == pytest.approx(want, abs=1e-9)
    assert -1.0 - 1e-12 <= got <= 1.0 + 1e-12
    assert cosine_similarity(b, a) == pytest.approx(got, abs=1e-12)


def test_cosine_similarity_edges():
    assert cosine_similarity([0.0, 0.0], [1.0, 2.0]) == 0.0  # a zero vector: eps, not a division by zero
    assert cosine_similarity([1.0, 2.0], [2.0, 4.0]) == pytest.approx(1.0)
    assert cosine_similarity([1.0, 0.0], [-3.0, 0.0]) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="3 and 2 values"):
        cosine_similarity([1.0, 2.0, 3.0], [1.0, 2.0])
