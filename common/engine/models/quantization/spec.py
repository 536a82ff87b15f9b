"""What to quantize, checked against the engine config before any weight is read."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from common.engine.config import QUANTIZATION_METHODS, EngineConfig
from common.engine.model_files import BUNDLED_MODEL_NAME, bundled_gguf_path, is_hf_dir


@dataclass(frozen=True)
class QuantizationSpec:
    method: str  # one of QUANTIZATION_METHODS
    gguf_path: Path | None = None  # gguf: the file whose Q4_1 blocks are served

    def __post_init__(self) -> None:
        check_method(self.method)
        if self.method == "gguf" and self.gguf_path is None:
            raise ValueError("quantization gguf needs the GGUF file the model comes from")


def check_method(method: str) -> None:
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {method!r}")


def gguf_source_path(model: str | os.PathLike | None) -> Path:
    """The GGUF file `model` is served from (as model_files.resolve_model picks it), or a ValueError."""
    if model is None or str(model) in ("", "bundled", BUNDLED_MODEL_NAME):
        return bundled_gguf_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not is_hf_dir(path):
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    raise ValueError(f"quantization gguf serves the quantized blocks of a GGUF file, and model {str(model)!r} "
                     f"is not one (give a .gguf file, a directory holding one, or no model for the bundled "
                     f"{BUNDLED_MODEL_NAME}); quantization int8 quantizes a Hugging Face checkpoint")


def quantization_spec(config: EngineConfig) -> QuantizationSpec | None:
    """None when config asks for no quantization; a ValueError when it asks for one it cannot have."""
    if config.quantization is None:
        return None
    check_method(config.quantization)
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError(f"quantization {config.quantization} needs each projection's whole weight on one rank; "
                         f"it does not support tensor_parallel_size > 1 (got "
                         f"{config.parallel.tensor_parallel_size})")
    gguf_path = gguf_source_path(config.model) if config.quantization == "gguf" else None
    return QuantizationSpec(config.quantization, gguf_path)
