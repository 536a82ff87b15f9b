"""`pdserve bench serve-embed`'s client against a real in-process gateway with the synthetic
instance: every prompt embedded once, at most the concurrency in flight, and its refusals."""
from __future__ import annotations

import asyncio

import pytest

from bench.fakes.fake_decode import fake_embedding
from bench.peers.vllm_serve_embed import _load, main
from tests.unit.gateway.openai_api.test_server import MODEL, TOKENS, http_gateway


def test_the_client_embeds_every_prompt_within_its_concurrency():
    prompts = [[5 + i, 6, 7 + i] for i in range(12)]
    with http_gateway(token_ids=TOKENS, delay_s=0.01) as gw:
        result = asyncio.run(_load(f"http://{gw.http_address}", MODEL, prompts, concurrency=4))
        sent = gw.fake.embedding_servicer.requests
        assert sorted(list(r.prompt_token_ids) for r in sent[1:]) == sorted(prompts)  # after the warm-up one
    assert result["concurrency"] == 4 and result["requests_per_s"] > 0
    assert result["prompt_tokens_per_s"] == pytest.approx(3 * result["requests_per_s"])
    assert 0 < result["latency_p50_s"] <= result["latency_p99_s"]
    assert fake_embedding([1, 2]) == [2.0, 1.0, 2.0, 3.0]


def test_a_refused_request_fails_the_load():
    with http_gateway(token_ids=TOKENS) as gw:
        with pytest.raises(RuntimeError, match="404"):
            asyncio.run(_load(f"http://{gw.http_address}", "not-served", [[1, 2]], concurrency=1))


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--concurrency", "0", "--skip-vllm"])
    assert "--concurrency" in capsys.readouterr().err
