"""Bodies of POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, served only
when the gateway runs with --allow-runtime-lora-updating; the change itself is
gateway.lora_adapters'), and their answers: vLLM's plain-text success line."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.openai_api.errors import invalid_field
from gateway.openai_api.protocol import INT32, boolean, checked_fields, described, integer, parse_body, string

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
# Names travel as gRPC fields and seed cached blocks' hashes; a path is the instances' own.
MAX_LORA_NAME_CHARS = 256
MAX_LORA_PATH_CHARS = 4096


def _bounded_text(limit: int) -> Callable:
    @described({"type": "string", "minLength": 1, "maxLength": limit})
    def check(param: str, value) -> str:
        text = string(param, value)
        if not text or len(text) > limit:
            raise invalid_field(param, f"must be 1 to {limit} characters, got {len(text)}")
        if "\x00" in text:
            raise invalid_field(param, "must not contain NUL")
        return text
    return check


@described({"type": "boolean", "enum": [False]})
def _no_3d_weights(param: str, value) -> bool:
    if boolean(param, value):
        raise invalid_field(param, "3D (mixture-of-experts) LoRA weights are not served; the served models are dense")
    return False


LOAD_FIELDS: dict[str, Callable] = {"lora_name": _bounded_text(MAX_LORA_NAME_CHARS),
                                    "lora_path": _bounded_text(MAX_LORA_PATH_CHARS), "load_inplace": boolean,
                                    "is_3d_lora_weight": _no_3d_weights}
# vLLM takes lora_int_id and ignores it (the name is what identifies an adapter): so here.
UNLOAD_FIELDS: dict[str, Callable] = {"lora_name": _bounded_text(MAX_LORA_NAME_CHARS),
                                      "lora_int_id": integer(*INT32)}
REQUIRED_FIELDS = {"load": ["lora_name", "lora_path"], "unload": ["lora_name"]}


@dataclass
class LoadLoRAAdapter:
    lora_name: str
    lora_path: str  # the PEFT directory, on the instances' hosts
    load_inplace: bool = False  # replace the adapter served under lora_name


def parse_load_request(body: bytes) -> LoadLoRAAdapter:
    values = _required(checked_fields(parse_body(body), LOAD_FIELDS), "load")
    return LoadLoRAAdapter(values["lora_name"], values["lora_path"], values.get("load_inplace", False))


def parse_unload_request(body: bytes) -> str:
    """The adapter's name."""
    return _required(checked_fields(parse_body(body), UNLOAD_FIELDS), "unload")["lora_name"]


def _required(values: dict, kind: str) -> dict:
    for name in REQUIRED_FIELDS[kind]:
        if name not in values:
            raise invalid_field(name, "is required", code="missing_field")
    return values


def loaded_message(lora_name: str) -> str:
    return f"Success: LoRA adapter '{lora_name}' added successfully."


def unloaded_message(lora_name: str) -> str:
    return f"Success: LoRA adapter '{lora_name}' removed successfully."
