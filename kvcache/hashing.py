"""Prefix-cache keys: a hash per full block, chained from the parent block's hash."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# A block's key: sha256 over (parent key, token ids). Equal keys mean equal token prefixes.
BlockHash = bytes


def hash_block_tokens(parent_block_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block: sha256(parent hash + the block's token ids as int64).

    The first block of a sequence has no parent (None). NOTE: chaining makes a block's key
    depend on every token before it, so equal keys mean equal prefixes, not just equal
    blocks; sha256 rather than the builtin hash because a collision would silently reuse
    another prompt's KV.
    """
    digest = hashlib.sha256(parent_block_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def salt_hash(cache_salt: str | None) -> BlockHash | None:
    """The parent key of a sequence's first block under `cache_salt` (None: unsalted).

    Blocks under different salts never share keys, so a prompt cached under one salt is
    no hit (and no timing signal) under another."""
    if cache_salt is None:
        return None
    return hashlib.sha256(b"cache_salt\x00" + cache_salt.encode()).digest()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
) -> None:
    """Append to `block_hashes` the keys of the full blocks of `token_ids` not hashed yet.

    `block_hashes` holds the keys of the first len(block_hashes) blocks of `token_ids`
    (a request's list only grows: full blocks never change).
    """
    num_full_blocks = len(token_ids) // block_size
    root = salt_hash(cache_salt) if len(block_hashes) < num_full_blocks else None
    for i in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[i - 1] if i > 0 else root
        block_hashes.append(
            hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        )
