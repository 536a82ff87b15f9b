"""The compiled model path: torch.compile (inductor) around the model's forward pass.

Attention is the split point (an opaque custom op, common.engine.models.attention),
so inductor fuses everything between attentions — norms, RoPE, SiLU, residuals —
and, with freezing, treats the weights as constants and prepacks the linears
(oneDNN on CPU, which uses AMX / AVX512-BF16 for bf16). The token dimension is
dynamic: one graph serves every batch after warm-up (plus the one-token graph the
compiler specialises), so a run of varied batches does not recompile. Compiled
code is cached on disk (inductor's FX-graph and autotune caches, under the
pdserve cache directory) so a restart skips code generation.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)


def compile_cache_dir() -> Path:
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve" / "inductor"


def find_cpp_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would use, or None when the machine has none."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def num_compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def compile_forward(model: torch.nn.Module, device: torch.device, enforce_eager: bool) -> Callable:
    """The model's forward, compiled; the model itself where compiling is off or impossible.

    PDSERVE_ENFORCE_EAGER=1 in the environment turns compiling off like --enforce-eager
    (it sets that flag for the services)."""
    if enforce_eager or os.environ.get("PDSERVE_ENFORCE_EAGER", "").lower() in ("1", "true", "yes", "on"):
        logger.info("model runs eagerly (--enforce-eager)")
        return model
    if device.type == "cpu" and find_cpp_compiler() is None:
        logger.warning("no C++ compiler found (g++, c++, clang++ or $CXX): the model runs eagerly; "
                       "install one to compile it")
        return model
    import torch._inductor.config as inductor_config

    cache_dir = compile_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    inductor_config.freezing = True  # weights become constants: linears prepacked once
    inductor_config.fx_graph_cache = True
    logger.info("model compiled with torch.compile (inductor, freezing; cache %s)", cache_dir)
    return torch.compile(model, dynamic=True, fullgraph=True)


def compile_logits(model: torch.nn.Module, forward: Callable) -> Callable:
    """model.compute_logits, compiled alongside a compiled forward (its own graph: it runs on
    the sampled rows only). With freezing the LM head's weight is prepacked like the other
    linears, which matters most where it is tied to the embedding: eager it is a plain
    GEMV over the whole vocabulary (~40% slower on CPU for SmolLM2's 49k x 576 bf16)."""
    if forward is model:  # eager
        return model.compute_logits
    return torch.compile(model.compute_logits, dynamic=True, fullgraph=True)
