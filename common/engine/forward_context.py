"""The step's attention metadata, reachable from inside a compiled model.

A compiled graph cannot take AttentionMetadata as an input (its ints would become
guards and every new batch shape a recompile), so the runner publishes it here for
the duration of one forward pass and the attention custom op reads it back, as
vLLM's forward context does.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the attention module reads this one: no import cycle at run time
    from common.engine.models.attention import AttentionMetadata

_local = threading.local()


@contextlib.contextmanager
def forward_context(meta: "AttentionMetadata") -> Iterator[None]:
    previous = getattr(_local, "meta", None)
    _local.meta = meta
    try:
        yield
    finally:
        _local.meta = previous


def current_attention_metadata() -> "AttentionMetadata":
    meta = getattr(_local, "meta", None)
    if meta is None:
        raise RuntimeError("attention ran outside a forward pass: no forward context is set")
    return meta
