"""`pdserve bench multi-turn` over real gRPC on loopback, against the in-process fake
GenerateService, and over the OpenAI API of a real in-process gateway (its HTTP server
on 127.0.0.1, a fake decode instance behind it): each turn resends the conversation with
the server's answers."""
from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from bench.fakes.fake_generate import FAKE_TOKEN_IDS, FakeGenerateService
from bench.multi_turn import AnswerReader, benchmark, build_parser, make_conversations, main, run_conversation
from bench.serve.client import GrpcGenerateBackend, OpenAICompletionsBackend
from bench.serve.datasets import Vocabulary
from tests.unit.gateway.openai_api.test_server import MODEL, http_gateway

VOCAB = Vocabulary(1000, frozenset({2}))


def test_each_turn_resends_the_conversation_with_the_answers_it_got():
    [conversation] = make_conversations(1, VOCAB, np.random.default_rng(0), num_turns=3, system_prompt_len=20,
                                        num_system_prompts=1, user_len_range=(5, 8), output_len_range=(3, 6))

    async def scenario():
        async with FakeGenerateService() as fake:
            async with GrpcGenerateBackend(fake.address) as backend:
                return await run_conversation(backend, conversation, time.perf_counter()), fake.servicer.requests
    results, requests = asyncio.run(scenario())
    prompts = [list(r.token_ids.ids) for r in requests]
    expected, history = [], list(conversation.system_prompt)
    for user, output_len in zip(conversation.user_turns, conversation.output_lens):
        expected.append(history + user)
        history = expected[-1] + list(FAKE_TOKEN_IDS[:output_len])  # the fake's answer
    assert prompts == expected
    assert [r.sampling.max_tokens for r in requests] == conversation.output_lens
    assert [(r.turn, r.outcome.prompt_len, r.outcome.output_tokens) for r in results] == [
        (k, len(p), n) for k, (p, n) in enumerate(zip(expected, conversation.output_lens))]
    assert 2 not in {t for p in prompts for t in p}  # no special id in what the client wrote


def test_conversations_are_checked_against_max_model_len():
    with pytest.raises(ValueError, match="max_model_len 500"):
        make_conversations(2, VOCAB, np.random.default_rng(0), num_turns=4, system_prompt_len=100,
                           user_len_range=(50, 60), output_len_range=(40, 50), max_model_len=500)
    with pytest.raises(ValueError, match="ranges"):
        make_conversations(2, VOCAB, np.random.default_rng(0), user_len_range=(0, 4))


def test_a_run_reports_every_turn_and_ttft_by_turn(tmp_path):
    async def scenario():
        async with FakeGenerateService(first_token_delay_s=0.01) as fake:
            args = build_parser().parse_args([
                "--gateway", fake.address, "--num-conversations", "5", "--turns", "3", "--system-prompt-len", "16",
                "--user-len", "4-8", "--output-len", "2-4", "--max-concurrency", "2", "--disable-tqdm",
                "--json", str(tmp_path / "multi_turn.json")])
            return await benchmark(args), len(fake.servicer.requests)
    rc, num_calls = asyncio.run(scenario())
    assert (rc, num_calls) == (0, 15)
    result = json.loads((tmp_path / "multi_turn.json").read_text())
    assert result["metrics"]["completed"] == 15 and result["metrics"]["failed"] == 0
    assert [(row["turn"], row["completed"]) for row in result["by_turn"]] == [(1, 5), (2, 5), (3, 5)]
    assert [row["num_moved"] for row in result["by_turn"]] == [0, 0, 0]  # one server: nowhere to move
    assert {t["decode_instance_id"] for t in result["turns"]} == {"fake"}
    assert all(row["mean_ttft_ms"] >= 10 for row in result["by_turn"])
    # Prompts grow with the turns: each carries the turns and answers before it.
    prompt_lens = [row["mean_prompt_len"] for row in result["by_turn"]]
    assert prompt_lens[0] < prompt_lens[1] < prompt_lens[2]
    assert len(result["turns"]) == 15


def test_an_unreachable_gateway_is_one_clear_line(capsys):
    assert main(["--gateway", "127.0.0.1:1", "--disable-tqdm"]) == 1
    assert "cannot reach the server at 127.0.0.1:1" in capsys.readouterr().err
    assert main(["--backend", "openai", "--base-url", "http://127.0.0.1:1", "--disable-tqdm"]) == 1
    assert "cannot reach the server at http://127.0.0.1:1" in capsys.readouterr().err


def test_a_failed_turn_ends_its_conversation_with_the_error():
    [conversation] = make_conversations(1, VOCAB, np.random.default_rng(1), num_turns=3, system_prompt_len=8,
                                        num_system_prompts=1, user_len_range=(4, 4), output_len_range=(2, 2))

    async def scenario():
        async with FakeGenerateService(fail_every=2) as fake:  # the second call fails
            async with GrpcGenerateBackend(fake.address) as backend:
                return await run_conversation(backend, conversation, time.perf_counter())
    results = asyncio.run(scenario())
    assert [r.turn for r in results] == [0, 1]  # no third turn: there is no answer to carry on from
    assert results[0].outcome.success and results[0].decode_instance_id == "fake"
    assert results[1].outcome.error.startswith("UNAVAILABLE: injected failure")


ANSWER_IDS = [504, 3458, 314, 4649, 30]  # the fake decode's answer, cycled


def test_over_the_openai_api_each_turn_resends_the_answers_token_ids():
    [conversation] = make_conversations(1, VOCAB, np.random.default_rng(2), num_turns=3, system_prompt_len=20,
                                        num_system_prompts=1, user_len_range=(5, 8), output_len_range=(3, 7))

    async def converse(base_url: str):
        async with OpenAICompletionsBackend(base_url, MODEL, return_token_ids=True) as backend:
            return await run_conversation(backend, conversation, time.perf_counter())
    with http_gateway(token_ids=ANSWER_IDS, num_cached_tokens=11) as gw:
        results = asyncio.run(converse(f"http://{gw.http_address}/v1"))
        prompts = [list(r.prompt_token_ids) for r in gw.fake.servicer.requests]
    expected, history = [], list(conversation.system_prompt)
    for user, output_len in zip(conversation.user_turns, conversation.output_lens):
        expected.append(history + user)
        history = expected[-1] + [ANSWER_IDS[i % len(ANSWER_IDS)] for i in range(output_len)]
    assert prompts == expected
    # Tokens counted from the ids (exact), cached tokens from usage.prompt_tokens_details.
    assert [(r.outcome.output_tokens, r.num_cached_tokens, r.outcome.success) for r in results] == [
        (n, 11, True) for n in conversation.output_lens]


def test_over_the_openai_api_a_conversation_needs_the_token_ids():
    with pytest.raises(ValueError, match="return_token_ids"):
        AnswerReader(OpenAICompletionsBackend("http://127.0.0.1:1"))
    args = build_parser().parse_args(["--backend", "openai", "--base-url", "http://127.0.0.1:9"])
    assert (args.backend, args.base_url) == ("openai", "http://127.0.0.1:9")


def test_over_the_chat_api_each_turn_resends_the_messages_with_the_answers_text():
    from bench.multi_turn import words
    from bench.serve.client import OpenAIChatBackend
    from common.engine.model_files import resolve_model
    from common.text.tokenizer import load_tokenizer
    [conversation] = make_conversations(1, VOCAB, np.random.default_rng(3), num_turns=3, system_prompt_len=12,
                                        num_system_prompts=1, user_len_range=(4, 6), output_len_range=(5, 5))

    async def converse(base_url: str):
        async with OpenAIChatBackend(base_url, MODEL) as backend:
            return await run_conversation(backend, conversation, time.perf_counter())
    with http_gateway(token_ids=ANSWER_IDS, num_cached_tokens=9) as gw:
        results = asyncio.run(converse(f"http://{gw.http_address}/v1"))
        prompts = [list(r.prompt_token_ids) for r in gw.fake.servicer.requests]
    tokenizer = load_tokenizer(resolve_model(None))
    answer_text = tokenizer.decode(ANSWER_IDS)
    texts = [tokenizer.decode(p) for p in prompts]
    assert len(texts) == 3 and all(words(conversation.system_prompt) in t for t in texts)
    for turn, text in enumerate(texts):
        assert all(words(user) in text for user in conversation.user_turns[:turn + 1])
        assert text.count(answer_text) == turn  # every answer so far, as the server wrote it
    assert prompts[1][:len(prompts[0])] == prompts[0]  # the history is the same tokens again
    # The prompt length is the server's count (the template's tokens included), not the words'.
    assert [r.outcome.prompt_len for r in results] == [len(p) for p in prompts]
    assert [(r.outcome.output_tokens, r.num_cached_tokens) for r in results] == [(5, 9)] * 3
