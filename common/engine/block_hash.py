"""Chained block hashes: the one function the engines and the gateway share.

Each full block's hash covers its parent's hash and its own token ids, so equal
hashes mean equal prefixes. sha256 (not Python's salted `hash`) keeps the value
the same in every process and on every machine.

A request's cache_salt (vLLM's) seeds its first block's parent: requests share cached
blocks only when their salts are equal (or both absent), so one tenant cannot learn from
time to first token whether another sent a prompt.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_PARENT_HASH = 0
# vLLM's bounds on a salt: cache backends take it into keys and paths.
MAX_CACHE_SALT_CHARS = 128
CACHE_SALT_FORBIDDEN_CHARS = "@/\\\0"


def check_cache_salt(cache_salt: str) -> str:
    """The salt, or ValueError saying what vLLM's bounds refuse."""
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError("cache_salt must be a non-empty string")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS or any(c in CACHE_SALT_FORBIDDEN_CHARS for c in cache_salt):
        raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters and must not contain "
                         f"'@', '/', '\\' or NUL")
    return cache_salt


def root_parent_hash(cache_salt: str | None, lora_name: str | None = None) -> int:
    """The parent hash of a request's first block: ROOT_PARENT_HASH for the base model
    unsalted, else its salt's and LoRA adapter's (whose KV differs from the base model's)."""
    if cache_salt is None and lora_name is None:
        return ROOT_PARENT_HASH
    payload = b"pdserve-cache-salt\0" + (cache_salt or "").encode()
    if lora_name is not None:
        payload += b"\0lora\0" + lora_name.encode()
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little")


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
