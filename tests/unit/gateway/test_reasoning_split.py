"""output.split_reasoning on gRPC: the gateway's --reasoning-parser splits a reasoning model's
thinking off the text, whole and streamed (the synthetic decode answers with scripted tokens)."""
from __future__ import annotations

import grpc
import pytest

from common.engine.sampling_params import SamplingParams
from gateway.client import Client
from gateway.validation import load_served_model
from tests.support.background_gateway import BackgroundGateway

ANSWER = "<think>\nThe capital of France.\n</think>\n\nParis."
TOKENS = load_served_model(None).tokenizer.encode(ANSWER, add_special_tokens=False)


@pytest.fixture(scope="module")
def gateway():
    with BackgroundGateway(reasoning_parser="qwen3") as gw:
        gw.add_fake_decode("decode-0", token_ids=TOKENS, delay_s=0.001)
        yield gw


def test_the_thinking_comes_split_off_the_text_whole_and_streamed(gateway):
    with Client(gateway.address, timeout=10) as client:
        whole = client.generate("hi", max_tokens=len(TOKENS), split_reasoning=True)
        assert (whole.reasoning, whole.text) == ("\nThe capital of France.\n", "\n\nParis.")
        chunks = list(client.generate_stream("hi", max_tokens=len(TOKENS), split_reasoning=True))
        assert "".join(c.reasoning for c in chunks) == whole.reasoning
        assert "".join(c.text for c in chunks) == whole.text
        assert not any("</think>" in c.reasoning + c.text for c in chunks)  # the markers never go out
        plain = client.generate("hi", max_tokens=len(TOKENS))
        assert (plain.reasoning, plain.text) == ("", ANSWER)  # only when asked
        # an answer constrained from its first token holds no thinking: all of it is text
        constrained = client.generate("hi", sampling=SamplingParams(
            max_tokens=len(TOKENS), structured_outputs={"regex": ".*"}), split_reasoning=True)
        assert (constrained.reasoning, constrained.text) == ("", ANSWER)


def test_asking_without_a_parser_is_invalid_argument():
    with BackgroundGateway() as gw:
        gw.add_fake_decode("decode-0", token_ids=TOKENS)
        with Client(gw.address, timeout=10) as client, pytest.raises(grpc.RpcError) as refused:
            client.generate("hi", max_tokens=3, split_reasoning=True)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--reasoning-parser" in refused.value.details()
