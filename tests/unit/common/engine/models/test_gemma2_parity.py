"""Gemma 2 matches transformers token for token: scaled embeddings, (1 + weight) sandwich
norms, GeGLU, query_pre_attn_scalar, attention and final soft-capping, and sliding
windows (8 positions, shorter than most test sequences) on alternate layers."""
from __future__ import annotations

import pytest

from tests.unit.common.engine.models.family_parity import assert_matches_transformers, save_tiny_model

CASES = {
    "gemma2-defaults": dict(),
    # Caps low enough that most scores and logits are bent by the tanh.
    "gemma2-tight-softcaps": dict(attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                                  num_hidden_layers=3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gemma2_matches_transformers(tmp_path, bundled_model_dir, name):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    model_dir = save_tiny_model(tmp_path, Gemma2Config, Gemma2ForCausalLM, bundled_model_dir, head_dim=16,
                                query_pre_attn_scalar=24, sliding_window=8, pad_token_id=0,
                                # Tied at this init, the sqrt(hidden)-scaled embedding swamps
                                # the layers and every prompt repeats its last token.
                                initializer_range=0.1, tie_word_embeddings=False,
                                **CASES[name])
    assert_matches_transformers(model_dir)
