"""PEFT LoRA adapters made in the tests (no download): random A and B over a base model's
linears, saved as PEFT saves them, with PEFT's own merged model beside them as the reference."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from common.engine.lora.adapter import LLAMA_TARGET_MODULES

# Found, not imported: importing peft (and the transformers models it pulls in) took ~4 s of
# each pytest process that collected a module needing it.
requires_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def make_adapter(base_dir: Path, out_dir: Path, seed: int, targets=LLAMA_TARGET_MODULES, rank: int = 4,
                 alpha: float = 8, use_rslora: bool = False) -> tuple[str, Path]:
    """(the PEFT adapter's directory, its merged model's) for the base model at base_dir."""
    import peft
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                             init_lora_weights=False, use_rslora=use_rslora)  # B random too: a real delta
    tuned = peft.get_peft_model(model, config)
    tuned.save_pretrained(out_dir / "adapter", safe_serialization=True)
    tuned.merge_and_unload().save_pretrained(out_dir / "merged", safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (base_dir / name).exists():
            shutil.copy(base_dir / name, out_dir / "merged" / name)
    return str(out_dir / "adapter"), out_dir / "merged"
