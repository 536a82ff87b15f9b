"""The architecture registry: every family resolves, an unknown one fails with the list."""
from __future__ import annotations

import json

import pytest

from common.engine.config import ModelConfig
from common.engine.models.registry import SUPPORTED_ARCHITECTURES, UnsupportedArchitectureError, model_class

TINY = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2)


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_every_supported_architecture_builds(architecture):
    cfg = ModelConfig.from_hf_config({"architectures": [architecture], **TINY})
    model = model_class(architecture)(cfg)
    assert type(model).__name__ == architecture


def test_unknown_architecture_names_it_and_lists_supported():
    with pytest.raises(UnsupportedArchitectureError) as excinfo:
        ModelConfig.from_hf_config({"architectures": ["FalconForCausalLM"], **TINY})
    message = str(excinfo.value)
    assert "'FalconForCausalLM'" in message
    for architecture in SUPPORTED_ARCHITECTURES:
        assert architecture in message


def test_unknown_architecture_fails_engine_start(tmp_path):
    from common import LLM
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"], **TINY}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="unsupported architecture 'GPTNeoXForCausalLM'; supported: "
                                         "LlamaForCausalLM"):
        LLM(model=str(tmp_path))


def test_model_type_without_architectures_list():
    assert ModelConfig.from_hf_config({"model_type": "qwen2", **TINY}).architecture == "Qwen2ForCausalLM"
