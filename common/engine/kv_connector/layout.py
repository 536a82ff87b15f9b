"""What a KV transfer's bytes mean, as one hash both ends compare before any byte moves.

The pool geometry (layers, dtype, block shape) says whether blocks fit; it does not say
whether they are right: two models of one shape but another RoPE base, norm or weights
file would exchange well-formed, wrong KV. The layout therefore covers everything the
transferred KV depends on: the target model's whole config, the KV dtype, the block
size, and which layers travel. Only the target's layers ever travel: a decode
instance with a speculative draft model prefills the draft's KV itself, so speculation
on either side leaves the layout, and so which pools can pair, unchanged.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

from common.engine.config import ModelConfig

# The KV layers a transfer carries, in order.
TRANSFERRED_LAYER_GROUPS = ("target",)


def kv_layout(model_config: ModelConfig, dtype: str, block_size: int) -> dict:
    return {"model": dataclasses.asdict(model_config), "dtype": dtype, "block_size": block_size,
            "layer_groups": list(TRANSFERRED_LAYER_GROUPS)}


def kv_layout_hash(layout: dict) -> str:
    """16 hex digits of the layout's SHA-256 (canonical JSON)."""
    text = json.dumps(layout, sort_keys=True, separators=(",", ":"), default=list)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe_kv_layout(layout: dict) -> str:
    model = layout["model"]
    return (f"{model['architecture']} ({model['num_hidden_layers']} layers, {model['num_key_value_heads']} KV "
            f"heads of {model['head_dim']}, rope_theta {model['rope_theta']}), {layout['dtype']}, "
            f"block size {layout['block_size']}, layers {'+'.join(layout['layer_groups'])}")
