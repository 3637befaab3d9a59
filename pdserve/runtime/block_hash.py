"""Content identity of a KV block: hash(parent, tokens of the block, model, kv dtype).

Chaining the parent's hash makes a block's identity its whole prefix, so equal hashes mean
equal KV. The gateway, the workers and the kvstore all name blocks by these 16-byte digests.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def block_hash(parent: bytes | None, token_ids: Sequence[int], fingerprint: str, kv_dtype: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(f"{fingerprint}|{kv_dtype}|".encode())
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return h.digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, fingerprint: str, kv_dtype: str,
                        include_partial: bool = False) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` (and of the partial tail when asked)."""
    hashes: list[bytes] = []
    parent = None
    end = len(token_ids) if include_partial else len(token_ids) - len(token_ids) % block_size
    for start in range(0, end, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size], fingerprint, kv_dtype)
        hashes.append(parent)
    return hashes
