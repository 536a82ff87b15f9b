"""Qwen3 (per-head q/k RMSNorm) matches transformers token for token."""
from __future__ import annotations

import pytest

from tests.unit.common.engine.models.family_parity import assert_matches_transformers, save_tiny_model


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_qwen3_matches_transformers(tmp_path, bundled_model_dir, tie_word_embeddings):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    model_dir = save_tiny_model(tmp_path, Qwen3Config, Qwen3ForCausalLM, bundled_model_dir, head_dim=16,
                                tie_word_embeddings=tie_word_embeddings)
    assert_matches_transformers(model_dir)
