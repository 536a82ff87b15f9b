"""`pdserve bench lora`'s adapters and workload (the timed runs are the benchmark, not a test):
the adapter it writes is one the engine loads, and bad bounds are refused."""
from __future__ import annotations

import pytest
import torch

from bench.lora import main, workload, write_adapter
from common.engine.config import ModelConfig
from common.engine.lora.adapter import load_adapter
from common.engine.model_files import load_hf_config


def test_the_written_adapter_loads_on_its_model(tiny_llama_dir, tmp_path):
    cfg = ModelConfig.from_hf_config(load_hf_config(tiny_llama_dir))
    path = write_adapter(tmp_path / "a", cfg, rank=4, seed=1)
    adapter = load_adapter("a", path, cfg, max_lora_rank=4, dtype=torch.float32, device=torch.device("cpu"))
    assert adapter.rank == 4 and adapter.scaling == 2.0 and len(adapter.weights) == 7 * cfg.num_hidden_layers


def test_the_workload_is_seeded_and_bounded():
    prompts = workload(20, 8, 16, 49152, seed=2)
    assert prompts == workload(20, 8, 16, 49152, seed=2) and all(8 <= len(p) <= 16 for p in prompts)


def test_bad_bounds_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--rank", "0"])
    assert "--rank" in capsys.readouterr().err
