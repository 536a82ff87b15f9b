"""Speculative decoding on the decode instance of a real disaggregated stack (bundled
model, one prefill and one decode process): greedy outputs equal the offline engine's
without speculation, and the decode instance's metrics show the drafts it verified."""
from __future__ import annotations

import json

import pytest

from common.cli.up import LocalStack
from gateway.client import Client
from tests.integration.test_metrics import scrape

pytestmark = pytest.mark.slow

SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                      "prompt_lookup_max": 4, "disable_by_batch_size": None, "min_acceptance_rate": 0.0}
PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, "
           "and wrote the names of passing ships in a leather logbook.")
PROMPTS = [
    f"Repeat this sentence exactly, word for word: {PASSAGE}\nRepeated: ",
    f"{PASSAGE}\nCopy the text above in capital letters? No, copy it as it is:\n",
    "Write a short poem about the sea.",
    "List the first ten prime numbers, separated by commas:",
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def expected():
    from common import LLM, SamplingParams
    llm = LLM(kv_cache_memory="256MiB")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.engine.shutdown()
    return [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outputs]


def test_greedy_outputs_with_speculation_on_decode_equal_the_offline_engine(tmp_path, expected):
    flags = ["--kv-cache-memory", "256MiB", "--log-level", "WARNING"]
    with LocalStack(1, 1, passthrough=flags, log_dir=tmp_path,
                    role_flags={"decode": ["--speculative-config", json.dumps(SPECULATIVE_CONFIG),
                                           "--local-prefill-threshold", "1"]}) as stack:
        with Client(stack.address, timeout=120) as client:
            for prompt_token_ids, want in expected:
                result = client.generate(token_ids=prompt_token_ids, temperature=0.0, max_tokens=MAX_TOKENS,
                                         return_token_ids=True)
                assert result.token_ids == want
                assert result.prefill_instance_id == "prefill-0"  # prefilled remotely, decoded speculatively
        samples = scrape(stack.instances["decode-0"].metrics_address)
    labels = frozenset({"role": "decode", "instance_id": "decode-0"}.items())
    num_draft_tokens = samples[("pdserve_spec_decode_num_draft_tokens_total", labels)]
    num_accepted = samples[("pdserve_spec_decode_num_accepted_tokens_total", labels)]
    assert num_draft_tokens > 0 and num_accepted > 0, (num_draft_tokens, num_accepted)
