"""Similarity scores from embeddings: vLLM's score task for an embedding model (its
"bi-encoder" scoring, behind LLM.score, /score and /rerank). Each query and each
document is embedded once, on its own, and a pair's score is the cosine similarity of
the two vectors. Plain Python, so the gateway's /score and /rerank and the offline
LLM.score compute the same numbers the same way.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence

# torch.nn.functional.cosine_similarity's floor on each vector's norm: a zero vector scores 0.
COSINE_EPS = 1e-8


def score_pairs(num_queries: int, num_documents: int) -> list[tuple[int, int]]:
    """(query index, document index) per score, in the documents' order: one query against
    every document (1:1, 1:N) or each query against its own document (N:N), vLLM's rules."""
    if num_queries == 0:
        raise ValueError("at least one query must be given")
    if num_documents == 0:
        raise ValueError("at least one document must be given")
    if num_queries > 1 and num_queries != num_documents:
        raise ValueError(f"{num_queries} queries and {num_documents} documents: the two must be 1:1, 1:N or N:N")
    return [(0 if num_queries == 1 else i, i) for i in range(num_documents)]


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """a . b / (max(|a|, eps) * max(|b|, eps)), torch's cosine_similarity of two vectors."""
    if len(a) != len(b):
        raise ValueError(f"vectors of {len(a)} and {len(b)} values have no cosine similarity")
    dot = math.fsum(map(operator.mul, a, b))
    return dot / (max(math.hypot(*a), COSINE_EPS) * max(math.hypot(*b), COSINE_EPS))
