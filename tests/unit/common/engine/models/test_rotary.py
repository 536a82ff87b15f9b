"""Our RoPE tables against transformers' for each scaling variant config.json can name."""
from __future__ import annotations

import json

import pytest
import torch

from common.engine.config import ModelConfig
from common.engine.models.causal_lm import build_rope

SHAPE = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
             num_attention_heads=4, max_position_embeddings=512)
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


def hf_cos_sin(hf_config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[hf_config.rope_parameters["rope_type"]](hf_config, None)
    freqs = torch.outer(positions.float(), inv_freq.float())  # [num_positions, head_dim // 2]
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


@pytest.mark.parametrize("name", list(SCALINGS))
def test_rope_tables_match_transformers(name):
    from transformers import LlamaConfig
    hf_config = LlamaConfig(**SHAPE, rope_scaling=dict(SCALINGS[name]))
    cfg = ModelConfig.from_hf_config({**json.loads(hf_config.to_json_string()),
                                      "architectures": ["LlamaForCausalLM"]})
    positions = torch.arange(0, 512, 7)
    cos, sin = build_rope(cfg).cos_sin(positions, torch.float32)
    hf_cos, hf_sin = hf_cos_sin(hf_config, positions)
    torch.testing.assert_close(cos[:, 0], hf_cos, atol=2e-4, rtol=0)
    torch.testing.assert_close(sin[:, 0], hf_sin, atol=2e-4, rtol=0)


def test_unknown_rope_type_names_the_supported_ones():
    cfg = ModelConfig.from_hf_config({**SHAPE, "architectures": ["LlamaForCausalLM"],
                                      "rope_scaling": {"rope_type": "mrope", "factor": 2.0}})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'mrope'; supported: default"):
        build_rope(cfg)
