"""Prompts that decode instances prefill themselves are placed by their cached prefixes:
`pdserve up --prefill 0 --decode 2` (LocalStack) on the bundled model. The decode instances
publish KV events, which the gateway follows, and answer GetCachedBlocks for its resyncs."""
from __future__ import annotations


import grpc
import pytest

from common.cli.up import LocalStack
from gateway.client import Client
from protos.pdserve.v1 import decode_pb2_grpc, prefill_pb2
from tests.integration.test_stack import wait_until_the_gateway_sees_no_load

pytestmark = pytest.mark.slow

SYSTEM = ("You are a helpful assistant for a hardware store. Answer briefly and name the aisle. "
          "The store has aisles for paint, lumber, plumbing, electrical, garden and tools. ") * 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LocalStack(0, 2, passthrough=["--kv-cache-memory", "128MiB", "--log-level", "WARNING"],
                    log_dir=tmp_path_factory.mktemp("decode-routing-logs")) as local_stack:
        yield local_stack


# Each customer's own part spans several blocks, so the instance holding a conversation saves
# more than a block's worth of prefill over the other one, which caches the shared system prompt.
ERRANDS = {"ann": ("wall paint", "repainting the kitchen, the hallway and two bedrooms this weekend, all "
                                  "in a pale green satin finish, and I have never painted a ceiling before"),
           "bob": ("copper pipe", "replacing the leaking pipes under the bathroom sink and the washing "
                                  "machine hookup in the basement, and I need fittings that match the old ones")}


def test_a_conversation_follows_the_decode_instance_that_caches_it(stack):
    with Client(stack.address, timeout=120) as client:
        turns = {name: f"{SYSTEM}Customer {name}: I am {errand}. Where do I find {item}?"
                 for name, (item, errand) in ERRANDS.items()}
        # Both at once: by load, one on each instance.
        streams = {name: client.generate_stream(prompt, max_tokens=8, temperature=0, ignore_eos=True)
                   for name, prompt in turns.items()}
        answers = {name: list(stream) for name, stream in streams.items()}
        first_instance = {name: deltas[-1].decode_instance_id for name, deltas in answers.items()}
        assert set(first_instance.values()) == {"decode-0", "decode-1"}
        wait_until_the_gateway_sees_no_load(stack)
        # Idle and equally loaded, load alone would send both next turns to decode-0; each goes where
        # its conversation's KV is, and finds it cached.
        for name in ("bob", "ann"):
            prompt = turns[name] + "".join(d.text for d in answers[name]) + " And what about brushes?"
            reply = client.generate(prompt, max_tokens=4, temperature=0, return_token_ids=True)
            assert reply.decode_instance_id == first_instance[name], name
            num_first_prompt_tokens = answers[name][-1].usage.prompt_tokens
            assert reply.usage.cached_prompt_tokens >= num_first_prompt_tokens // 16 * 16 - 16, name
            wait_until_the_gateway_sees_no_load(stack)


def test_a_decode_instance_answers_get_cached_blocks_with_its_prefix_cache(stack):
    with Client(stack.address, timeout=120) as client:
        reply = client.generate(f"{SYSTEM}Customer cy: where is the garden hose?", max_tokens=2, temperature=0)
    with grpc.insecure_channel(stack.instances[reply.decode_instance_id].address) as channel:
        snapshot = decode_pb2_grpc.DecodeServiceStub(channel).GetCachedBlocks(
            prefill_pb2.GetCachedBlocksRequest(), timeout=10)
    assert snapshot.instance_id == reply.decode_instance_id
    assert snapshot.sequence > 0 and len(snapshot.block_hashes) >= reply.usage.prompt_tokens // 16
