"""Phi-3 (fused qkv and gate/up weights, longrope scaling, partial rotary) matches transformers."""
from __future__ import annotations

import pytest

from tests.unit.common.engine.models.family_parity import assert_matches_transformers, save_tiny_model


def longrope(num_freqs: int) -> dict:
    # Within original_max_position_embeddings (all test sequences) the short factors apply;
    # factor 4 = max_position_embeddings / original scales cos/sin by sqrt(1 + ln 4 / ln 128).
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(num_freqs)],
            "long_factor": [2.0 + 0.5 * i for i in range(num_freqs)]}


CASES = {
    "phi3-default-rope": dict(),
    "phi3-longrope": dict(original_max_position_embeddings=128, rope_scaling=longrope(8)),
    "phi4-mini-partial-rotary": dict(original_max_position_embeddings=128, partial_rotary_factor=0.5,
                                     rope_scaling={**longrope(4), "partial_rotary_factor": 0.5},
                                     tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_phi3_matches_transformers(tmp_path, bundled_model_dir, name):
    from transformers import Phi3Config, Phi3ForCausalLM
    model_dir = save_tiny_model(tmp_path, Phi3Config, Phi3ForCausalLM, bundled_model_dir, pad_token_id=0,
                                **CASES[name])
    assert_matches_transformers(model_dir)
