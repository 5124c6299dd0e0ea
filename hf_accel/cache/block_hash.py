"""Block keys: the hash chain that names a full block of tokens by everything before it. Plain Python, no torch.

A block's key is SHA-256 over (its parent block's key, its token ids), so equal keys mean equal prefixes. The
engine's prefix cache and the `PrefixStore` key blocks the same way.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence


def block_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Key of a full block: SHA-256 of the parent's key and the block's token ids."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", tokens).tobytes())  # 8 bytes per id: one C call, no per-token Python
    return digest.digest()


def block_keys(tokens: Sequence[int], block_size: int, parent: bytes | None = None) -> Iterator[bytes]:
    """Keys of the full blocks of `tokens` in order, chained from `parent` (the key of the block before them);
    lazy, so a caller that stops at the first unknown key hashes no further."""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start : start + block_size])
        yield parent
