"""Mistral matches transformers token for token, its sliding window (8 positions, shorter
than most test sequences) included."""
from __future__ import annotations

import pytest

from tests.unit.common.engine.models.family_parity import assert_matches_transformers, save_tiny_model


@pytest.mark.parametrize("sliding_window", [8, None])
def test_mistral_matches_transformers(tmp_path, bundled_model_dir, sliding_window):
    from transformers import MistralConfig, MistralForCausalLM
    model_dir = save_tiny_model(tmp_path, MistralConfig, MistralForCausalLM, bundled_model_dir,
                                sliding_window=sliding_window, head_dim=16)
    assert_matches_transformers(model_dir)
