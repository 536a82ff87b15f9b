"""The step's attention metadata, reachable from inside a compiled model.

A compiled graph cannot take AttentionMetadata as an input (its ints would become
guards and every new batch shape a recompile), so the runner publishes it here for
the duration of one forward pass and the attention custom op reads it back, as
vLLM's forward context does. On CPU with the native attention kernel, the step's ragged
batch is also published to that kernel's library (kernels/cpu_attention.publish_step):
a compiled graph's per-layer attention then reads it from C++ without a Python op.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kernels.cpu_attention import cpu_attention_backend, publish_step

if TYPE_CHECKING:  # the attention module reads this one: no import cycle at run time
    from common.engine.models.attention import AttentionMetadata

_local = threading.local()


@contextlib.contextmanager
def forward_context(meta: "AttentionMetadata") -> Iterator[None]:
    previous = getattr(_local, "meta", None)
    _local.meta = meta
    native = meta.slot_mapping.device.type == "cpu" and cpu_attention_backend() == "native"
    if native:
        _publish_native(meta)
    try:
        yield
    finally:
        _local.meta = previous
        if native:
            _publish_native(previous)


def _publish_native(meta: "AttentionMetadata | None") -> None:
    """The native kernel's copy of the step: set where that kernel alone serves every layer
    (a ragged batch, no per-layer KV-connector hook), cleared otherwise."""
    if meta is not None and meta.query_start_loc is not None and meta.kv_layer_hook is None:
        publish_step(meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens)
    else:
        publish_step(None)


def current_attention_metadata() -> "AttentionMetadata":
    meta = getattr(_local, "meta", None)
    if meta is None:
        raise RuntimeError("attention ran outside a forward pass: no forward context is set")
    return meta
