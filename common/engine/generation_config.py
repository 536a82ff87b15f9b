"""The model's recommended sampling defaults: vLLM's --generation-config (no torch).

A model's generation_config.json may recommend how to sample it (Qwen3: temperature 0.6,
top_p 0.95, top_k 20). As vLLM does by default ("auto"), a request that leaves temperature,
top_p, top_k, min_p or repetition_penalty unset takes the model's value, and the config's
max_new_tokens bounds every request's max_tokens. "vllm" keeps the engine's own defaults; a
folder reads that folder's generation_config.json instead of the model's. Overrides
(--override-generation-config, vLLM's flag) add or replace values, under the same names.

Values equal to transformers' own defaults (temperature 1, top_k 50, top_p 1,
repetition_penalty 1) are left out, as vLLM leaves them out: it reads the file as
transformers' difference from those defaults, so a file that writes top_k 50 leaves vLLM's
top-k off, and so it does here. Overrides are taken as given.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GENERATION_CONFIG_FILE = "generation_config.json"
# Where vLLM reads the file as transformers' difference from these, a value equal to one is no value.
TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _valid(name: str, value: Any) -> bool:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    is_int = isinstance(value, int) and not isinstance(value, bool)
    return {"temperature": is_number and value >= 0, "top_p": is_number and 0 < value <= 1,
            "top_k": is_int and value >= -1, "min_p": is_number and 0 <= value <= 1,
            "repetition_penalty": is_number and value > 0, "max_new_tokens": is_int and value >= 1}[name]


@dataclass(frozen=True)
class SamplingDefaults:
    """What requests get where they leave a field unset, in the OpenAI API's names."""
    sampling: dict[str, float | int] = field(default_factory=dict)  # temperature, top_p, top_k, min_p, ...
    max_tokens: int | None = None  # every request's bound (max_new_tokens); None: none

    def __bool__(self) -> bool:
        return bool(self.sampling) or self.max_tokens is not None

    def describe(self) -> str:
        values = {**self.sampling, **({"max_tokens": self.max_tokens} if self.max_tokens is not None else {})}
        return ", ".join(f"{name}={value}" for name, value in values.items())


def load_sampling_defaults(model_dir: Path, generation_config: str = "auto",
                           overrides: dict[str, Any] | None = None) -> SamplingDefaults:
    """The defaults `generation_config` ("auto", "vllm" or a folder) and `overrides` give; a
    ValueError naming the file or the flag and the field where a value is not one a request
    could send."""
    if generation_config == "vllm":
        source, values = "", {}
    else:
        folder = model_dir if generation_config == "auto" else Path(generation_config).expanduser()
        if generation_config != "auto" and not folder.is_dir():
            raise ValueError(f"--generation-config {generation_config!r}: not 'auto', 'vllm' or a folder")
        path = folder / GENERATION_CONFIG_FILE
        source, values = str(path), _read(path)
        values = {name: value for name, value in values.items()
                  if name not in TRANSFORMERS_DEFAULTS or value != TRANSFORMERS_DEFAULTS[name]}
    known = (*SAMPLING_FIELDS, "max_new_tokens")
    for name, value in (overrides or {}).items():
        if name not in known:
            raise ValueError(f"--override-generation-config: unknown field {name!r}; it takes {', '.join(known)}")
        if value is not None and not _valid(name, value):
            raise ValueError(f"--override-generation-config: {name}={json.dumps(value)} is not a valid value")
    for name in known:
        value = values.get(name)
        if value is not None and not _valid(name, value):
            raise ValueError(f"{source}: {name}={json.dumps(value)} is not a valid value (or override it with "
                             f"--override-generation-config, or pass --generation-config vllm)")
    values = {**values, **(overrides or {})}
    if values.get("top_k") == 0:  # transformers' "no top-k" is SamplingParams' -1
        values["top_k"] = -1
    return SamplingDefaults(sampling={name: values[name] for name in SAMPLING_FIELDS if values.get(name) is not None},
                            max_tokens=values.get("max_new_tokens"))


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it as JSON: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return values
