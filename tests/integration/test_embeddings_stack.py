"""Embeddings on the real stack (1 gateway, 1 prefill, 1 decode, the bundled model):
gRPC Embed and HTTP /v1/embeddings give the offline engine's vectors, /score and /rerank
its LLM.score, the prompt an embedding computed stays cached for generation, a decode
instance embeds too, and an embedding cancelled mid-prompt leaves no work or block behind."""
from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from common.engine.model_files import resolve_model
from common.engine.pooling_params import PoolingParams
from common.engine.scoring import cosine_similarity as cosine
from common.service.embedding_api import EmbedJob
from common.service.embedding_client import EmbeddingClient
from common.text.prompt_tokenizer import load_prompt_tokenizer
from tests.integration.test_stack import wait_until_idle

pytestmark = pytest.mark.slow

DOCUMENT = ("Embeddings turn text into vectors. " + " ".join(
    f"Sentence {i} describes the colour {colour} and the number {i * 7}." for i, colour in enumerate(
        ["red", "green", "blue", "yellow", "purple", "orange"])))
TEXTS = [DOCUMENT, "A short query about colours"]
# bf16 on both sides; the stack's steps batch the prompt differently than one offline call may.
MIN_COSINE = 0.999
SCORE_TOLERANCE = 5e-3
QUERIES = ["Which colour is sentence 2 about?", "Numbers and colours"]


@pytest.fixture(scope="module")
def offline():
    from common.engine.llm import LLM
    llm = LLM(num_kv_blocks=128, max_num_seqs=8)
    vectors = {text: out.outputs.embedding for text, out in zip(TEXTS, llm.embed(TEXTS))}
    vectors["raw"] = llm.embed(TEXTS[1], PoolingParams(normalize=False))[0].outputs.embedding
    vectors["scores"] = [out.outputs.score for out in llm.score(TEXTS[1], QUERIES + TEXTS)]
    llm.engine.shutdown()
    return vectors


def test_grpc_and_http_give_the_offline_engines_vectors(stack, grpc_client, client, model, offline):
    for text in TEXTS:
        result = grpc_client.embed(text)
        assert result.instance_id == "prefill-0"  # prompts are computed where prefills are
        assert len(result.embedding) == 576 and cosine(result.embedding, offline[text]) >= MIN_COSINE
    raw = grpc_client.embed(TEXTS[1], pooling=PoolingParams(normalize=False)).embedding
    assert cosine(raw, offline["raw"]) >= MIN_COSINE
    assert math.sqrt(math.fsum(v * v for v in raw)) == pytest.approx(
        math.sqrt(math.fsum(v * v for v in offline["raw"])), rel=1e-2)
    response = client.embeddings.create(model=model, input=TEXTS)  # the openai client: base64
    for data, text in zip(response.data, TEXTS):
        assert cosine(data.embedding, offline[text]) >= MIN_COSINE
    assert response.usage.prompt_tokens == sum(grpc_client.embed(t).usage.prompt_tokens for t in TEXTS)
    wait_until_idle(stack)


def test_score_and_rerank_give_the_offline_engines_scores(stack, offline):
    import http.client
    import json

    def post(path: str, body: dict) -> dict:
        connection = http.client.HTTPConnection(*stack.http_address.split(":"), timeout=60)
        try:
            connection.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
            response = connection.getresponse()
            payload = json.loads(response.read())
            assert response.status == 200, payload
            return payload
        finally:
            connection.close()
    documents = QUERIES + TEXTS
    scores = [d["score"] for d in post("/score", {"queries": TEXTS[1], "documents": documents})["data"]]
    assert scores == pytest.approx(offline["scores"], abs=SCORE_TOLERANCE)
    assert scores[-1] == pytest.approx(1.0, abs=1e-3)  # the query against itself
    ranked = post("/rerank", {"query": TEXTS[1], "documents": documents, "top_n": 2})["results"]
    assert ranked[0]["index"] == len(documents) - 1 and len(ranked) == 2
    assert ranked[1]["relevance_score"] == pytest.approx(sorted(offline["scores"])[-2], abs=SCORE_TOLERANCE)
    wait_until_idle(stack)


def test_an_embedded_prompt_stays_cached_for_generation(stack, grpc_client):
    prompt = "A unique opening for the cache test. " + DOCUMENT  # no block of it is cached yet
    first = grpc_client.embed(prompt)
    generated = grpc_client.generate(prompt, max_tokens=1)
    assert generated.usage.cached_prompt_tokens >= 16, generated.usage
    again = grpc_client.embed(prompt)
    assert again.usage.cached_prompt_tokens >= 16 and first.usage.cached_prompt_tokens == 0
    assert cosine(again.embedding, first.embedding) >= MIN_COSINE
    wait_until_idle(stack)


def test_a_decode_instance_embeds_too(stack, offline):
    prompt_token_ids = load_prompt_tokenizer(resolve_model()).encode(TEXTS[1])

    async def embed_on_decode():
        client = EmbeddingClient(stack.instances["decode-0"].address)
        try:
            return await client.embed(EmbedJob("on-decode", prompt_token_ids, PoolingParams()), timeout_s=60)
        finally:
            await client.close()
    result = asyncio.run(embed_on_decode())
    assert result.instance_id == "decode-0" and cosine(result.embedding, offline[TEXTS[1]]) >= MIN_COSINE
    wait_until_idle(stack)


def test_refusals_and_a_cancelled_embedding_leave_nothing(stack, grpc_client, client, model):
    with pytest.raises(grpc.RpcError) as error:
        grpc_client.embed("x", pooling=PoolingParams(dimensions=8))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Matryoshka" in error.value.details()
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as bad:
        client.embeddings.create(model=model, input="x", dimensions=8)
    assert bad.value.body["param"] == "dimensions"
    long_prompt = " ".join(f"word{i}" for i in range(3000))
    with pytest.raises(grpc.RpcError) as error:
        grpc_client.embed(long_prompt, timeout=0.05, truncate_prompt_tokens=-1)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The abort lands between two steps: after the step of the prompt's first chunk (2,048
    # tokens on one thread), which took over 15 s on a loaded 2-core Zen 3.
    wait_until_idle(stack, timeout_s=60)
    assert grpc_client.embed("still serving").embedding
