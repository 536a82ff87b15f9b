"""POST /score and /rerank, vLLM's scoring routes for an embedding model: each query and
each document is embedded once through Gateway.embed, and a pair's score is the cosine
similarity of the two vectors (common.engine.scoring, what the offline LLM.score computes).

    /score  (also /v1/score): queries and documents (or vLLM's other names for the two
            sides: queries and items, data_1 and data_2, text_1 and text_2), 1:1, 1:N or
            N:N; one score per document, in order.
    /rerank (also /v1/rerank, /v2/rerank; Jina's and Cohere's shape): one query and its
            documents; the documents by relevance, best first, the top_n of them (0: all).

The other fields are vLLM's: model, user, use_activation (normalize; a cosine is the
same either way), truncate_prompt_tokens, max_tokens_per_query and max_tokens_per_doc
(a text cut to its first N tokens before it is embedded, vLLM's way: at a character the
tokenizer's offsets give), priority, request_id, cache_salt. instruction and chat_template_kwargs
feed a cross-encoder's score template, which an embedding model has not: a 400 naming
them. Checked as protocol.py checks every body (an unknown field is a 400 naming it).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.engine.pooling_params import PoolingParams
from common.engine.scoring import cosine_similarity, score_pairs
from common.service.errors import ServiceError
from gateway.core import Gateway
from gateway.openai_api.choices import all_or_none
from gateway.openai_api.embeddings import EMBEDDING_FIELDS, MAX_EMBEDDING_INPUTS
from gateway.openai_api.errors import invalid_field
from gateway.openai_api.protocol import (INT32, boolean, cache_salt, checked_fields, described, integer, parse_body,
                                         string)
from gateway.types import EmbeddingResult, EmbedInput

# A side's texts at most: as many as one embeddings request's inputs.
MAX_SCORE_TEXTS = MAX_EMBEDDING_INPUTS
# vLLM's names for the two sides of /score, in the order it looks for them.
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
_TEXT = {"type": "string", "minLength": 1}


def _text(param: str, value: Any) -> str:
    if isinstance(value, dict):
        raise invalid_field(param, "is multimodal content; this model takes text only", code="unsupported_value")
    if not string(param, value):
        raise invalid_field(param, "must not be empty")
    return value


@described({"anyOf": [_TEXT, {"type": "array", "minItems": 1, "maxItems": MAX_SCORE_TEXTS, "items": _TEXT}],
            "description": f"a text or a list of them (at most {MAX_SCORE_TEXTS})"})
def score_texts(param: str, value: Any) -> list[str]:
    if not isinstance(value, list):
        return [_text(param, value)]
    if not value:
        raise invalid_field(param, "must hold at least one text")
    if len(value) > MAX_SCORE_TEXTS:
        raise invalid_field(param, f"must hold at most {MAX_SCORE_TEXTS} texts, got {len(value)}")
    return [_text(f"{param}[{i}]", text) for i, text in enumerate(value)]


@described({**_TEXT, "description": "the one query the documents are ranked against"})
def one_text(param: str, value: Any) -> str:
    if isinstance(value, list):
        raise invalid_field(param, "must be one text: a rerank ranks documents against one query")
    return _text(param, value)


@described({"type": "null", "description": "a cross-encoder's score-template option; not for an embedding model"})
def cross_encoder_only(param: str, value: Any) -> None:
    raise invalid_field(param, "feeds a cross-encoder's score template; this model scores as an embedding model "
                               "(the cosine similarity of two embeddings), which has none", code="unsupported_value")


_COMMON_FIELDS: dict[str, Callable] = {
    "model": string, "user": string, "use_activation": boolean,
    "truncate_prompt_tokens": EMBEDDING_FIELDS["truncate_prompt_tokens"],
    "max_tokens_per_query": integer(0, INT32[1]), "max_tokens_per_doc": integer(0, INT32[1]),
    "priority": integer(*INT32), "request_id": string, "cache_salt": cache_salt,
    "instruction": cross_encoder_only, "chat_template_kwargs": cross_encoder_only,
}
SCORE_FIELDS: dict[str, Callable] = {**_COMMON_FIELDS, **{name: score_texts for side in SCORE_SIDES for name in side}}
RERANK_FIELDS: dict[str, Callable] = {**_COMMON_FIELDS, "query": one_text, "documents": score_texts,
                                      "top_n": integer(0, INT32[1])}


@dataclass
class ParsedScoreRequest:
    """A /score or /rerank body, checked; the two sides under the names the request used."""

    model: str | None
    queries: list[str]
    documents: list[str]
    query_field: str = "queries"
    document_field: str = "documents"
    queries_listed: bool = True  # the side came as a list: an error names its item (queries[2])
    documents_listed: bool = True
    pooling: PoolingParams = field(default_factory=PoolingParams)
    request_id: str | None = None
    priority: int = 0
    truncate_prompt_tokens: int | None = None
    max_tokens_per_query: int = 0  # 0: the whole text
    max_tokens_per_doc: int = 0
    top_n: int | None = None  # rerank: how many to return (0: all); None: a /score request
    cache_salt: str | None = None
    trace_headers: dict[str, str] = field(default_factory=dict)  # the HTTP request's W3C trace context

    @property
    def is_rerank(self) -> bool:
        return self.top_n is not None

    def input_field(self, is_query: bool, index: int) -> str:
        """The request field (and item) one embedded text came from."""
        name, listed = ((self.query_field, self.queries_listed) if is_query
                        else (self.document_field, self.documents_listed))
        return f"{name}[{index}]" if listed else name


def _parsed(raw: dict, values: dict, query_field: str, document_field: str, top_n: int | None) -> ParsedScoreRequest:
    queries = values[query_field]
    return ParsedScoreRequest(
        model=values.get("model"), queries=queries if isinstance(queries, list) else [queries],
        documents=values[document_field], query_field=query_field, document_field=document_field,
        queries_listed=isinstance(raw[query_field], list), documents_listed=isinstance(raw[document_field], list),
        pooling=PoolingParams(normalize=values.get("use_activation")), request_id=values.get("request_id"),
        priority=values.get("priority", 0), truncate_prompt_tokens=values.get("truncate_prompt_tokens"),
        max_tokens_per_query=values.get("max_tokens_per_query", 0),
        max_tokens_per_doc=values.get("max_tokens_per_doc", 0), top_n=top_n, cache_salt=values.get("cache_salt"))


def parse_score_request(body: bytes) -> ParsedScoreRequest:
    raw = parse_body(body)
    values = checked_fields(raw, SCORE_FIELDS)
    sent = [name for side in SCORE_SIDES for name in side if name in values]
    for query_field, document_field in SCORE_SIDES:
        if set(sent) == {query_field, document_field}:
            parsed = _parsed(raw, values, query_field, document_field, None)
            try:
                score_pairs(len(parsed.queries), len(parsed.documents))
            except ValueError as e:
                raise invalid_field(document_field, str(e)) from None
            return parsed
    names = " or ".join(f"{first} and {second}" for first, second in SCORE_SIDES)
    # The other half of a pair half sent, else the pair sent beside another.
    missing = next((name for side in SCORE_SIDES if set(side) & set(sent) for name in side if name not in sent), None)
    raise invalid_field(missing or (sent[-1] if sent else "queries"), f"set one pair of {names}",
                        code="missing_field" if missing or not sent else "invalid_value")


def parse_rerank_request(body: bytes) -> ParsedScoreRequest:
    raw = parse_body(body)
    values = checked_fields(raw, RERANK_FIELDS)
    for name in ("query", "documents"):
        if name not in values:
            raise invalid_field(name, "is required", code="missing_field")
    return _parsed(raw, values, "query", "documents", values.get("top_n", 0))


def _first_tokens(tokenizer, text: str, max_tokens: int) -> str:
    """text cut to its first max_tokens tokens (special tokens aside) at a character the
    tokenizer's offsets give, not through a decode (vLLM's truncate_text_to_tokens: a cut
    can merge into fewer tokens, never more, so the loop ends)."""
    while text:
        offsets = tokenizer.backend.encode(text, add_special_tokens=False).offsets
        if len(offsets) <= max_tokens:
            break
        text = text[:min(offsets[max_tokens - 1][1], offsets[max_tokens][0], len(text) - 1)]
    return text


def _truncated(parsed: ParsedScoreRequest, tokenizer, max_model_len: int) -> tuple[list[str], list[str]]:
    queries, documents = parsed.queries, parsed.documents
    for name, limit in (("max_tokens_per_query", parsed.max_tokens_per_query),
                        ("max_tokens_per_doc", parsed.max_tokens_per_doc)):
        if limit >= max_model_len:
            raise invalid_field(name, f"must be less than max_model_len ({max_model_len}), got {limit}")
    if parsed.max_tokens_per_query:
        queries = [_first_tokens(tokenizer, text, parsed.max_tokens_per_query) for text in queries]
    if parsed.max_tokens_per_doc:
        documents = [_first_tokens(tokenizer, text, parsed.max_tokens_per_doc) for text in documents]
    return queries, documents


@dataclass
class Scores:
    """A request's scores, one per document in order, and the tokens its embeddings read."""

    scores: list[float]
    num_prompt_tokens: int
    num_cached_tokens: int


async def score_all(gateway: Gateway, parsed: ParsedScoreRequest, response_id: str) -> Scores:
    """Every query and document embedded at once (the first failure cancels the rest and
    is raised, its field in `param`), then each pair's cosine similarity."""
    queries, documents = parsed.queries, parsed.documents
    if parsed.max_tokens_per_query or parsed.max_tokens_per_doc:
        queries, documents = await asyncio.to_thread(_truncated, parsed, gateway.model.tokenizer,
                                                     gateway.max_model_len)
    base_id = parsed.request_id or response_id
    calls = []
    for is_query, texts in ((True, queries), (False, documents)):
        for index, text in enumerate(texts):
            request = EmbedInput(text=text, pooling=parsed.pooling, priority=parsed.priority,
                                 request_id=f"{base_id}-{'q' if is_query else 'd'}{index}", model=parsed.model or "",
                                 truncate_prompt_tokens=parsed.truncate_prompt_tokens, cache_salt=parsed.cache_salt,
                                 trace_headers=parsed.trace_headers)
            calls.append(_embedded(gateway, request, parsed.input_field(is_query, index)))
    results = await all_or_none(calls)
    query_results, document_results = results[:len(queries)], results[len(queries):]
    scores = [cosine_similarity(query_results[q].embedding, document_results[d].embedding)
              for q, d in score_pairs(len(queries), len(documents))]
    return Scores(scores, sum(r.usage.prompt_tokens for r in results),
                  sum(r.usage.cached_prompt_tokens for r in results))


async def _embedded(gateway: Gateway, request: EmbedInput, param: str) -> EmbeddingResult:
    try:
        return await gateway.embed(request)
    except ServiceError as e:
        # The field a refusal is about, for the HTTP error: the field (and item) whose text
        # this was, unless the limit the request set is what it broke.
        if e.code == grpc.StatusCode.INVALID_ARGUMENT:
            e.param = "truncate_prompt_tokens" if e.message.startswith("truncate_prompt_tokens") else param
        raise


def scores_response(parsed: ParsedScoreRequest, scores: Scores, response_id: str, model_name: str) -> dict:
    """/score's list of scores in the documents' order, or /rerank's results: the documents
    best first (ties in the order sent), the top_n of them where it is set and smaller."""
    if not parsed.is_rerank:
        return {"id": response_id, "object": "list", "created": int(time.time()), "model": model_name,
                "data": [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores.scores)],
                "usage": _usage(scores, completion_tokens=0)}
    results = sorted(({"index": i, "document": {"text": text}, "relevance_score": score}
                      for i, (text, score) in enumerate(zip(parsed.documents, scores.scores))),
                     key=lambda result: -result["relevance_score"])
    if parsed.top_n:
        results = results[:parsed.top_n]
    return {"id": response_id, "model": model_name, "usage": _usage(scores), "results": results}


def _usage(scores: Scores, **extra: int) -> dict:
    return {"prompt_tokens": scores.num_prompt_tokens, "total_tokens": scores.num_prompt_tokens, **extra,
            "prompt_tokens_details": {"cached_tokens": scores.num_cached_tokens}}
