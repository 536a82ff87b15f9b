"""The structured-output manager's grammar backend: built ahead of the first constrained
request on a thread (as services do at start-up), from the vocabulary alone."""
from __future__ import annotations

import logging

import pytest

import xgrammar as xgr

from common.engine.model_files import resolve_model
from common.engine.sampling_params import SamplingParams
from common.engine.structured_output.manager import StructuredOutputManager
from common.text.tokenizer import load_eos_token_ids


def manager_for(model_dir) -> StructuredOutputManager:
    return StructuredOutputManager(model_dir, 49152, load_eos_token_ids(model_dir))


def test_a_warm_up_builds_the_backend_before_any_request_and_counts_no_compile(tiny_llama_dir):
    manager = manager_for(tiny_llama_dir)
    assert not manager.is_warm
    manager.warm_up_in_background().join(timeout=60)
    assert manager.is_warm
    assert manager.stats()["structured_output_compiles"] == 0  # the warm-up's own compile is not one
    manager.compile(SamplingParams(structured_outputs={"json_object": True}))
    manager.compile(SamplingParams(structured_outputs={"json_object": True}))
    assert manager.stats()["structured_output_compiles"] == 1


def test_a_failed_warm_up_is_logged_and_the_first_request_answers_with_the_error(tmp_path, caplog):
    (tmp_path / "config.json").write_text("{}")  # a directory without tokenizer.json
    manager = StructuredOutputManager(tmp_path, 1000, (2,))
    with caplog.at_level(logging.WARNING):
        manager.warm_up_in_background().join(timeout=60)
    assert not manager.is_warm
    assert "warming up the grammar backend failed" in caplog.text
    with pytest.raises(ValueError, match="tokenizer"):
        manager.compile(SamplingParams(structured_outputs={"regex": "[0-9]+"}))


def test_the_vocabulary_tokenizer_gives_xgrammar_what_the_full_tokenizer_gives(tiny_llama_dir):
    from transformers import AutoTokenizer

    from common.text.tokenizer import load_vocabulary_tokenizer
    for model_dir in (resolve_model(None), tiny_llama_dir):
        eos = list(load_eos_token_ids(model_dir))
        light = xgr.TokenizerInfo.from_huggingface(load_vocabulary_tokenizer(model_dir), vocab_size=49152,
                                                   stop_token_ids=eos)
        full = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir, local_files_only=True),
                                                  vocab_size=49152, stop_token_ids=eos)
        assert light.dump_metadata() == full.dump_metadata()
        assert light.decoded_vocab == full.decoded_vocab


def test_an_engine_asked_to_warm_its_grammar_backend_has_it_once_built(tiny_llama_dir):
    from common.engine.config import CacheConfig, EngineConfig
    from common.engine.engine_core import EngineCore
    config = EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=8, num_blocks=16))
    warm = EngineCore(config, warm_grammar_backend=True)
    cold = EngineCore(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=8, num_blocks=16)))
    try:
        assert warm.structured_output.is_warm and not cold.structured_output.is_warm
    finally:
        warm.shutdown()
        cold.shutdown()
