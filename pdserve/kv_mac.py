"""The KV block MAC: HMAC-SHA256 keyed by a cluster secret that only prefill and decode workers hold.

The kvstore (and Redis behind it) is a cache anyone with its address, and perhaps the internal
token, can write into, and the first block stored under a hash wins. So a block's content is bound
to its identity here: the writer signs (content hash, wire header, payload) with the cluster KV
key, every reader verifies before the block can reach the model, and a block that fails is
recomputed. The kvstore never needs the key: it stores the MAC as part of the opaque block bytes.

The key comes from PDSERVE_KV_MAC_KEY (the secret itself) or PDSERVE_KV_MAC_KEY_FILE (a file
holding it, for secrets mounts), read once by the worker's main (`key_from_env`, into its
`pdserve.worker_config.WorkerConfig`), which hands it to the worker. Every worker of a cluster
needs the same key. `pdserve up` generates one for its children when
none is set; `generate_key` makes one.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from pathlib import Path

KEY_ENV = "PDSERVE_KV_MAC_KEY"
KEY_FILE_ENV = "PDSERVE_KV_MAC_KEY_FILE"
MAC_SIZE = hashlib.sha256().digest_size  # 32 bytes
NO_MAC = bytes(MAC_SIZE)  # what an unsigned block (written without a key) carries
# Domain separation: a MAC made for a KV block is never valid for anything else keyed alike.
_DOMAIN = b"pdserve-kv-block-mac-v1\0"

MIN_KEY_CHARS = 16


def key_from_env(env: Mapping[str, str]) -> bytes:
    """The key of PDSERVE_KV_MAC_KEY in `env`, else of the file PDSERVE_KV_MAC_KEY_FILE names, else
    b"" (none); ValueError when it is too short (`check_key`)."""
    key = env.get(KEY_ENV, "").strip()
    path = env.get(KEY_FILE_ENV, "").strip()
    if not key and path:
        try:
            key = Path(path).read_text().strip()
        except OSError as err:
            raise ValueError(f"{KEY_FILE_ENV}={path}: {err.strerror or err}") from err
    return check_key(key.encode())


def check_key(key: bytes) -> bytes:
    """`key`, unless it is set and shorter than MIN_KEY_CHARS (ValueError naming the variables)."""
    if key and len(key) < MIN_KEY_CHARS:
        # A short key could be guessed offline from one genuine block; refuse it at start.
        raise ValueError(f"the KV MAC key ({KEY_ENV} / {KEY_FILE_ENV}) is {len(key)} characters; use at least "
                         f"{MIN_KEY_CHARS}, e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`")
    return key


def generate_key() -> str:
    """A fresh random key (64 hex chars, 256 bits)."""
    return secrets.token_hex(32)


def sign(key: bytes, block_hash: bytes, header: bytes, payload: bytes | memoryview) -> bytes:
    """The MAC of one block: over its content hash (so it cannot be replayed under another hash),
    its wire header (without the MAC field) and its payload."""
    mac = hmac.new(key, _DOMAIN, hashlib.sha256)
    mac.update(len(block_hash).to_bytes(2, "little"))  # length-prefixed: no ambiguity with the header
    mac.update(block_hash)
    mac.update(header)
    mac.update(payload)
    return mac.digest()


def verify(key: bytes, block_hash: bytes, header: bytes, payload: bytes | memoryview, mac: bytes) -> bool:
    """True when `mac` is the block's MAC under `key` (compared in constant time)."""
    return hmac.compare_digest(sign(key, block_hash, header, payload), mac)
