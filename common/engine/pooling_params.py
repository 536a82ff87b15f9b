"""Per-request embedding parameters (vLLM's PoolingParams for the embed task) and how the
served model pools (its sentence-transformers config). Plain Python.

An embedding request runs its prompt through the model like a prefill and samples
nothing: the engine pools the final hidden states (after the last norm) of the prompt's
tokens as the model's sentence-transformers config says (POOLING_TYPES; the last token's
state where it says nothing, the pooling of decoder embedding models: Qwen3-Embedding,
e5-mistral, gte-Qwen2), and `pool` turns the pooled state into the embedding. Last-token
pooling needs only the last token's state, so a prompt whose head is in the prefix cache
computes only its tail, as a generation request does; the other poolings read every
token's state, so their prompts take no prefix-cache hits (`pools_every_token`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from common.engine.json_options import json_object_option

# An embedding's values cross the wire as floats; a vector this long is larger than any
# hidden size served today (8,192 for 70B-class models, 16,384 for the largest).
MAX_EMBEDDING_DIMENSIONS = 65_536
# sentence-transformers' Pooling config flags -> the pooling they name (vLLM's names).
_ST_POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                     "pooling_mode_cls_token": "CLS", "pooling_mode_max_tokens": "MAX",
                     "pooling_mode_mean_sqrt_len_tokens": "MEAN_SQRT_LEN",
                     "pooling_mode_weightedmean_tokens": "WEIGHTED_MEAN"}
# What each pooling makes of a prompt's final hidden states h_0 .. h_{n-1}, as
# sentence-transformers computes it: the last state, their mean, the first (CLS), their
# element-wise maximum, their sum / sqrt(n), their mean weighted by position (i + 1).
POOLING_TYPES = ("LAST", "MEAN", "CLS", "MAX", "MEAN_SQRT_LEN", "WEIGHTED_MEAN")
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolingConfig:
    """How the served model makes embeddings: what its sentence-transformers config
    (modules.json, the Pooling module's config.json) says, as vLLM reads it; a model
    without one pools the last token and normalizes."""

    # One of POOLING_TYPES, or several joined by "+" where the config concatenates them
    # (for_model refuses those).
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
            # Several flags: sentence-transformers concatenates those poolings ("MEAN+MAX"),
            # which for_model refuses.
            pooling_type = "+".join(name for flag, name in _ST_POOLING_MODES.items() if flags.get(flag)) or "LAST"
        return cls(pooling_type=pooling_type, normalize=_ST_NORMALIZE in types)

    def overridden(self, overrides: dict | None) -> PoolingConfig:
        """This config with --pooler-config's fields (parse_pooler_config's) in place of its own."""
        return replace(self, **overrides) if overrides else self


# --pooler-config's keys (vLLM's flag) -> the PoolingConfig field each sets; vLLM also
# names the pooling seq_pooling_type, and normalizing use_activation.
_POOLER_CONFIG_KEYS = {"pooling_type": "pooling_type", "seq_pooling_type": "pooling_type",
                       "normalize": "normalize", "use_activation": "normalize"}


def parse_pooler_config(value: dict | str | None) -> dict | None:
    """LLM(pooler_config=...) or --pooler-config JSON ({"pooling_type": "MEAN", "normalize":
    false}) -> the PoolingConfig fields it overrides; ValueError naming what is wrong."""
    if value is None:
        return None
    overrides: dict = {}
    for key, item in json_object_option(value, "pooler_config", _POOLER_CONFIG_KEYS).items():
        field_name = _POOLER_CONFIG_KEYS[key]
        if field_name == "pooling_type":
            if not isinstance(item, str) or item.upper() not in POOLING_TYPES:
                raise ValueError(f"pooler_config {key} must be one of {', '.join(POOLING_TYPES)}; got {item!r}")
            item = item.upper()
        elif not isinstance(item, bool):
            raise ValueError(f"pooler_config {key} must be true or false; got {item!r}")
        if overrides.get(field_name, item) != item:
            raise ValueError(f"pooler_config sets {field_name} twice, to {overrides[field_name]!r} and {item!r}")
        overrides[field_name] = item
    return overrides


@dataclass(frozen=True)
class PoolingParams:
    # L2-normalize the vector; False: the raw hidden state; None: as the model's config says
    # (PoolingConfig.normalize: yes, unless its sentence-transformers modules leave Normalize out).
    normalize: bool | None = None
    # Matryoshka models: keep the first `dimensions` values (before normalizing);
    # None: the whole hidden state. Other models refuse it (for_model).
    dimensions: int | None = None
    # How the prompt's hidden states are pooled (POOLING_TYPES): the model's, set by
    # for_model (PoolingConfig.pooling_type), not by a request.
    pooling_type: str = "LAST"

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")
        dims = self.dimensions
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool)
                                 or not 1 <= dims <= MAX_EMBEDDING_DIMENSIONS):
            raise ValueError(f"dimensions must be an integer from 1 to {MAX_EMBEDDING_DIMENSIONS}, got {dims!r}")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")

    @property
    def pools_every_token(self) -> bool:
        """Whether pooling reads every prompt token's state (all but LAST): such a prompt is
        computed whole, without prefix-cache hits."""
        return self.pooling_type != "LAST"

    def for_model(self, hidden_size: int, is_matryoshka: bool, matryoshka_dimensions: tuple[int, ...] | None,
                  config: PoolingConfig) -> PoolingParams:
        """These params with the model's pooling and normalize resolved; ValueError where the
        model cannot serve them: `dimensions` where vLLM's rules refuse them (only a Matryoshka
        model, config.json `is_matryoshka` or `matryoshka_dimensions`, cuts its vectors, to one
        of its listed sizes where it lists them, never past hidden_size), or a model whose
        sentence-transformers config concatenates several poolings."""
        if config.pooling_type not in POOLING_TYPES:
            raise ValueError(f"this model's sentence-transformers Pooling config concatenates "
                             f"{config.pooling_type.replace('+', ' + ')}; pdserve pools one way per model, so "
                             f"its embeddings would not be the model's")
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
        normalize = config.normalize if self.normalize is None else self.normalize
        return replace(self, normalize=normalize, pooling_type=config.pooling_type)

    def pool(self, hidden_state: list[float]) -> list[float]:
        """The embedding of one prompt from its pooled final hidden state (normalize unset
        counts as true: for_model resolves it first)."""
        values = hidden_state if self.dimensions is None else hidden_state[:self.dimensions]
        if self.normalize is False:
            return list(values)
        # As torch's F.normalize: the norm floored at 1e-12, so a zero vector stays zero.
        norm = max(math.sqrt(math.fsum(v * v for v in values)), 1e-12)
        return [v / norm for v in values]
