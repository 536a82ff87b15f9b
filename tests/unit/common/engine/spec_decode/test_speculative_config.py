"""--speculative-config / LLM(speculative_config=...): parsed like vLLM's, every mistake named."""
from __future__ import annotations

import argparse
import json

import pytest

from common.engine.config import SpeculativeConfig
from common.engine.engine_args import add_engine_args, engine_config_from_args


def parse_flags(*argv: str):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_the_flag_takes_json_and_fills_defaults():
    config = parse_flags("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}')
    assert config.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=5)
    assert parse_flags().speculative is None


@pytest.mark.parametrize("value, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"method": "medusa"}', "must be one of ngram, early_exit, draft_model"),
    ('{"method": "ngram", "k": 3}', "unknown speculative_config keys ['k']"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be in 1..16"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min <= prompt_lookup_max"),
    ('{"method": "draft_model"}', "needs draft_model"),
    ('{"method": "early_exit", "num_early_exit_layers": 0}', "num_early_exit_layers must be >= 1"),
    ('{"method": "ngram", "min_acceptance_rate": 2}', "min_acceptance_rate must be in [0, 1]"),
    # Values of the wrong JSON type are named, not compared with numbers (nor true taken for 1).
    ('{"num_speculative_tokens": "3"}', "num_speculative_tokens: Input should be a valid integer"),
    ('{"min_acceptance_rate": "high"}', "min_acceptance_rate: Input should be a valid number"),
    ('{"large_batch_min_acceptance_rate": true}', "large_batch_min_acceptance_rate: Input should be a valid number"),
    ('{"disable_by_batch_size": 2.5}', "disable_by_batch_size: Input should be a valid integer"),
    ('{"draft_model": 7, "method": "draft_model"}', "draft_model: Input should be a valid string"),
])
def test_bad_configs_fail_naming_the_problem(value, message):
    """The flag's JSON, and the same object given to LLM(speculative_config=...)."""
    with pytest.raises(ValueError) as error:
        parse_flags("--speculative-config", value)
    assert message in str(error.value)
    if value.startswith("{\""):
        with pytest.raises(ValueError) as error:
            SpeculativeConfig.parse(json.loads(value))
        assert message in str(error.value)


def test_an_early_exit_as_deep_as_the_model_is_refused(tiny_llama_dir):
    from common.engine.llm import LLM
    with pytest.raises(ValueError, match="must be fewer than the model's 2 layers"):
        LLM(str(tiny_llama_dir), num_kv_blocks=16, speculative_config={"method": "early_exit",
                                                                      "num_early_exit_layers": 2})


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama_dir, tiny_model_factory):
    from common.engine.llm import LLM
    draft_dir = tiny_model_factory("other-vocab-draft", vocab_size=1000)
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        LLM(str(tiny_llama_dir), num_kv_blocks=16, speculative_config={"method": "draft_model",
                                                                      "draft_model": str(draft_dir)})
