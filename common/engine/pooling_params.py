"""Per-request embedding parameters (vLLM's PoolingParams for the embed task) and how the
served model pools (its sentence-transformers config). Plain Python.

An embedding request runs its prompt through the model like a prefill and samples
nothing: the engine takes the final hidden state (after the last norm) at the prompt's
last token, the pooling of decoder embedding models (Qwen3-Embedding, e5-mistral,
gte-Qwen2), and `pool` turns it into the embedding. Only the last token's state is
needed, so a prompt whose head is in the prefix cache computes only its tail, as a
generation request does.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

# An embedding's values cross the wire as floats; a vector this long is larger than any
# hidden size served today (8,192 for 70B-class models, 16,384 for the largest).
MAX_EMBEDDING_DIMENSIONS = 65_536
# sentence-transformers' Pooling config flags -> the pooling they name (vLLM's names).
_ST_POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                     "pooling_mode_cls_token": "CLS", "pooling_mode_max_tokens": "MAX",
                     "pooling_mode_mean_sqrt_len_tokens": "MEAN_SQRT_LEN",
                     "pooling_mode_weightedmean_tokens": "WEIGHTED_MEAN"}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolingConfig:
    """How the served model makes embeddings: what its sentence-transformers config
    (modules.json, the Pooling module's config.json) says, as vLLM reads it; a model
    without one pools the last token and normalizes."""

    pooling_type: str = "LAST"
    normalize: bool = True  # the default of requests that leave normalize unset

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> PoolingConfig:
        try:
            modules = json.loads((model_dir / "modules.json").read_text())
        except FileNotFoundError:
            return cls()
        types = {module.get("type") for module in modules}
        pooling = next((module for module in modules if module.get("type") == _ST_POOLING), None)
        pooling_type = "LAST"
        if pooling is not None:
            flags = json.loads((model_dir / pooling.get("path", "") / "config.json").read_text())
            pooling_type = next((name for flag, name in _ST_POOLING_MODES.items() if flags.get(flag)), "LAST")
        return cls(pooling_type=pooling_type, normalize=_ST_NORMALIZE in types)


@dataclass(frozen=True)
class PoolingParams:
    # L2-normalize the vector; False: the raw hidden state; None: as the model's config says
    # (PoolingConfig.normalize: yes, unless its sentence-transformers modules leave Normalize out).
    normalize: bool | None = None
    # Matryoshka models: keep the first `dimensions` values (before normalizing);
    # None: the whole hidden state. Other models refuse it (for_model).
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")
        dims = self.dimensions
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool)
                                 or not 1 <= dims <= MAX_EMBEDDING_DIMENSIONS):
            raise ValueError(f"dimensions must be an integer from 1 to {MAX_EMBEDDING_DIMENSIONS}, got {dims!r}")

    def for_model(self, hidden_size: int, is_matryoshka: bool, matryoshka_dimensions: tuple[int, ...] | None,
                  config: PoolingConfig) -> PoolingParams:
        """These params with normalize resolved for the model; ValueError where the model cannot
        serve them: a pooling other than the last token's (its sentence-transformers config
        names another), or `dimensions` where vLLM's rules refuse them (only a Matryoshka model,
        config.json `is_matryoshka` or `matryoshka_dimensions`, cuts its vectors, to one of its
        listed sizes where it lists them, never past hidden_size)."""
        if config.pooling_type != "LAST":
            raise ValueError(f"this model pools by {config.pooling_type} (its sentence-transformers Pooling "
                             f"config); pdserve pools the last token's hidden state only, so its embeddings "
                             f"would not be the model's")
        dims = self.dimensions
        if dims is not None:
            if not is_matryoshka:
                raise ValueError(f"dimensions: this model does not support Matryoshka representation, so its "
                                 f"embeddings have {hidden_size} values; leave dimensions out")
            if matryoshka_dimensions and dims not in matryoshka_dimensions:
                raise ValueError(f"dimensions: this model supports only {sorted(matryoshka_dimensions)}, "
                                 f"got {dims}")
            if dims > hidden_size:
                raise ValueError(f"dimensions: at most the model's hidden size of {hidden_size}, got {dims}")
        return self if self.normalize is not None else replace(self, normalize=config.normalize)

    def pool(self, hidden_state: list[float]) -> list[float]:
        """The embedding of one prompt from its last token's final hidden state (normalize
        unset counts as true: for_model resolves it first)."""
        values = hidden_state if self.dimensions is None else hidden_state[:self.dimensions]
        if self.normalize is False:
            return list(values)
        # As torch's F.normalize: the norm floored at 1e-12, so a zero vector stays zero.
        norm = max(math.sqrt(math.fsum(v * v for v in values)), 1e-12)
        return [v / norm for v in values]
