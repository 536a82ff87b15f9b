"""The LoRA tests' tiny base model and its two PEFT adapters (a: every linear, rank 5, odd as
the bf16 deltas' pairs of ranks must pad; b: three linears, rank 8, rsLoRA), each (adapter
directory, PEFT's merged model directory)."""
from __future__ import annotations

import pytest

from tests.support.peft_adapters import make_adapter


@pytest.fixture(scope="module")
def base_dir(tiny_model_factory):
    return tiny_model_factory("tiny-llama", "llama")


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {"a": make_adapter(base_dir, root / "a", seed=1, rank=5),
            "b": make_adapter(base_dir, root / "b", seed=2, targets=("q_proj", "v_proj", "down_proj"), rank=8,
                              alpha=4, use_rslora=True)}
