"""Chained block hashes: the one function the engines and the gateway share.

Each full block's hash covers its parent's hash and its own token ids, so equal
hashes mean equal prefixes. sha256 (not Python's salted `hash`) keeps the value
the same in every process and on every machine.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_PARENT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """64-bit hash of one full block given its parent's hash."""
    payload = struct.pack(f"<Q{len(token_ids)}I", parent_hash, *token_ids)
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little")


def compute_block_hashes(token_ids: Sequence[int], block_size: int,
                         parent_hash: int = ROOT_PARENT_HASH) -> list[int]:
    """Hashes of every full block of `token_ids` (a trailing partial block has none)."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start:start + block_size])
        hashes.append(parent_hash)
    return hashes
