"""POST /score and /rerank on a real in-process gateway with the synthetic instance (whose
Embed answers fake_embedding of the prompt it got): each score is the cosine similarity
of the two texts' embeddings, each text embedded once, every alias of the routes and of
the two sides, rerank's order and top_n, the texts cut to max_tokens_per_query/doc, and
every refusal a 400 naming its field with nothing sent to the instance. The real model is
in tests/integration/test_embeddings_stack.py."""
from __future__ import annotations

import pytest

from bench.fakes.fake_decode import fake_embedding
from common.engine.scoring import cosine_similarity
from gateway.openai_api.scores import MAX_SCORE_TEXTS
from tests.unit.gateway.openai_api.test_embeddings import embed_requests, embeddings_by_status, tokenize
from tests.unit.gateway.openai_api.test_server import MODEL, TOKENS, http_gateway, post

QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of France is Paris.", "Horses and cows are animals.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def gw():
    with http_gateway(token_ids=TOKENS) as gateway:
        yield gateway


def fake_score(gw, query: str, document: str) -> float:
    return cosine_similarity(fake_embedding(tokenize(gw, query)), fake_embedding(tokenize(gw, document)))


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_one_query_against_each_document_embeds_the_query_once(gw, path):
    before = len(embed_requests(gw))
    status, body = post(gw.http_address, path, {"model": MODEL, "queries": QUERY, "documents": DOCUMENTS,
                                                "request_id": "mine", "priority": -2, "use_activation": False})
    assert status == 200, body
    assert body["id"].startswith("score-") and body["object"] == "list" and body["model"] == MODEL
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"score"}
    assert [d["score"] for d in body["data"]] == pytest.approx([fake_score(gw, QUERY, d) for d in DOCUMENTS])
    assert body["data"][2]["score"] == pytest.approx(1.0)
    num_tokens = sum(len(tokenize(gw, text)) for text in [QUERY, *DOCUMENTS])
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    sent = {r.request_id: r for r in embed_requests(gw)[before:]}
    assert sorted(sent) == ["mine-d0", "mine-d1", "mine-d2", "mine-q0"]  # the query once
    assert list(sent["mine-q0"].prompt_token_ids) == tokenize(gw, QUERY)
    assert all(r.priority == -2 and r.pooling.normalize is False for r in sent.values())


@pytest.mark.parametrize("first, second", [("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                                           ("text_1", "text_2")])
def test_pairwise_under_each_name_of_the_two_sides(gw, first, second):
    queries, documents = ["first query", "second query"], ["a document", "second query"]
    status, body = post(gw.http_address, "/score", {first: queries, second: documents})
    assert status == 200, body
    assert [d["score"] for d in body["data"]] == pytest.approx(
        [fake_score(gw, q, d) for q, d in zip(queries, documents)])


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_returns_the_documents_best_first(gw, path):
    status, body = post(gw.http_address, path, {"query": QUERY, "documents": DOCUMENTS})
    assert status == 200, body
    scores = [fake_score(gw, QUERY, d) for d in DOCUMENTS]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    assert [r["index"] for r in body["results"]] == order
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in order]
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([scores[i] for i in order])
    assert body["id"].startswith("rerank-") and body["model"] == MODEL
    assert body["usage"]["prompt_tokens"] == sum(len(tokenize(gw, t)) for t in [QUERY, *DOCUMENTS])
    status, top = post(gw.http_address, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert status == 200 and top["results"] == body["results"][:2]


def test_texts_are_cut_to_their_first_tokens(gw):
    before = len(embed_requests(gw))
    status, body = post(gw.http_address, "/score", {"queries": "one two three four five six",
                                                    "documents": ["seven eight nine ten", "eleven"],
                                                    "max_tokens_per_query": 3, "max_tokens_per_doc": 2})
    assert status == 200, body
    sent = {r.request_id.rsplit("-", 1)[1]: list(r.prompt_token_ids) for r in embed_requests(gw)[before:]}
    assert sent == {"q0": tokenize(gw, "one two three"), "d0": tokenize(gw, "seven eight"),
                    "d1": tokenize(gw, "eleven")}
    assert body["data"][0]["score"] == pytest.approx(fake_score(gw, "one two three", "seven eight"))


@pytest.mark.parametrize("path, body, param", [
    ("/score", {"queries": ["a", "b"], "documents": ["x", "y", "z"]}, "documents"),
    ("/score", {"queries": "a"}, "documents"),
    ("/score", {"documents": ["a"]}, "queries"),
    ("/score", {"text_1": "a", "documents": ["b"]}, "queries"),
    ("/score", {"queries": "a", "documents": ["b"], "items": ["c"]}, "items"),
    ("/score", {}, "queries"),
    ("/score", {"queries": [], "documents": ["a"]}, "queries"),
    ("/score", {"queries": "", "documents": ["a"]}, "queries"),
    ("/score", {"queries": "a", "documents": ["b", 5]}, "documents[1]"),
    ("/score", {"queries": {"content": [{"type": "text", "text": "a"}]}, "documents": ["b"]}, "queries"),
    ("/score", {"queries": "a", "documents": ["b"] * (MAX_SCORE_TEXTS + 1)}, "documents"),
    ("/score", {"queries": "a", "documents": "b", "instruction": "Judge relevance"}, "instruction"),
    ("/score", {"queries": "a", "documents": "b", "chat_template_kwargs": {}}, "chat_template_kwargs"),
    ("/score", {"queries": "a", "documents": "b", "max_tokens_per_doc": -1}, "max_tokens_per_doc"),
    ("/score", {"queries": "a", "documents": "b", "max_tokens_per_query": 10**6}, "max_tokens_per_query"),
    ("/score", {"queries": "a", "documents": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/score", {"queries": "a", "documents": "b", "padding": "max_length"}, "padding"),
    ("/rerank", {"query": ["a", "b"], "documents": ["x"]}, "query"),
    ("/rerank", {"documents": ["x"]}, "query"),
    ("/rerank", {"query": "a"}, "documents"),
    ("/rerank", {"query": "a", "documents": ["x"], "top_n": -1}, "top_n"),
    ("/v2/rerank", {"query": "a", "documents": ["x"], "queries": ["b"]}, "queries"),
])
def test_bad_requests_are_400_naming_the_field(gw, path, body, param):
    before = len(embed_requests(gw))
    status, response = post(gw.http_address, path, body)
    assert status == 400, response
    assert response["error"]["param"] == param, response
    assert len(embed_requests(gw)) == before  # nothing reached the instance


def test_a_refused_text_names_its_item_and_another_model_is_404(gw):
    too_long = " ".join(["word"] * (gw.gateway.max_model_len + 10))
    status, body = post(gw.http_address, "/rerank", {"query": "a", "documents": ["fine", too_long]})
    assert status == 400 and body["error"]["param"] == "documents[1]", body
    status, body = post(gw.http_address, "/score", {"queries": "a", "documents": "b",
                                                     "truncate_prompt_tokens": 10**6})
    assert status == 400 and body["error"]["param"] == "truncate_prompt_tokens", body
    status, body = post(gw.http_address, "/score", {"model": "other", "queries": "a", "documents": "b"})
    assert status == 404 and body["error"]["param"] == "model"


def test_no_instance_is_503():
    with http_gateway() as gw:
        status, body = post(gw.http_address, "/rerank", {"query": "a", "documents": ["b"]})
        assert status == 503 and "no prefill or decode instance" in body["error"]["message"]


def test_each_text_is_counted_as_an_embedding_and_a_refused_request_once():
    with http_gateway(token_ids=TOKENS, with_metrics=True) as gw:
        assert post(gw.http_address, "/score", {"queries": "a", "documents": ["b", "c"]})[0] == 200
        assert post(gw.http_address, "/rerank", {"query": "a", "documents": ["b"]})[0] == 200
        assert post(gw.http_address, "/rerank", {"query": "a", "documents": []})[0] == 400
        assert embeddings_by_status(gw) == {"OK": 5.0, "INVALID_ARGUMENT": 1.0}
