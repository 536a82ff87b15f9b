"""Qwen2 / Qwen2.5 (q/k/v biases) matches transformers token for token; its config's
sliding_window applies only with use_sliding_window, to layers from max_window_layers on."""
from __future__ import annotations

import pytest

from tests.unit.common.engine.models.family_parity import assert_matches_transformers, save_tiny_model


@pytest.mark.parametrize("use_sliding_window", [False, True])
def test_qwen2_matches_transformers(tmp_path, bundled_model_dir, use_sliding_window):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    model_dir = save_tiny_model(tmp_path, Qwen2Config, Qwen2ForCausalLM, bundled_model_dir, sliding_window=8,
                                use_sliding_window=use_sliding_window, max_window_layers=1)
    assert_matches_transformers(model_dir)
