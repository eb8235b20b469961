"""Prefix-cache hashing of full KV pages.

Each full page of a request gets a hash chained from its parent page's hash:

    page 0: h0 = sha256(ROOT | tokens[0:16]  | extra keys, e.g. cache salt)
    page 1: h1 = sha256(h0   | tokens[16:32])
    page 2: h2 = sha256(h1   | tokens[32:48])

so equal hashes mean equal whole prefixes, not just equal pages. The parent
hash is always 32 bytes and a page's tokens always block_size * 8 bytes, so the
concatenation is unambiguous; extra keys go last. The root is a constant (not
random) so that data-parallel ranks and restarts agree on hashes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxserve.kv_cache_spec import cdiv  # noqa: F401  (one ceil-division for the engine core)

if TYPE_CHECKING:
    from jaxserve.engine_core.request import Request

# A page hash: 32 bytes of sha256.
BlockHash = bytes

ROOT_HASH: BlockHash = hashlib.sha256(b"jaxserve prefix cache root").digest()


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """A page hash as KV cache group `group` registers it: a page holds that group's layers'
    KV only (group 0's key is the hash itself)."""
    return block_hash if group == 0 else block_hash + bytes((group,))


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    block_token_ids: Sequence[int],
    extra_keys: bytes = b"",
) -> BlockHash:
    """Hash of one full page, chained from its parent's hash (None for page 0)."""
    h = hashlib.sha256(ROOT_HASH if parent_block_hash is None else parent_block_hash)
    h.update(array("q", block_token_ids).tobytes())
    h.update(extra_keys)
    return h.digest()


def request_extra_keys(request: Request) -> bytes:
    """Keys that make the first page's hash differ between requests whose
    tokens are equal but whose KV must not be shared (a cache salt)."""
    if request.cache_salt:
        return b"salt:" + request.cache_salt.encode()
    return b""


class RequestBlockHasher:
    """Computes the hashes of a request's newly filled pages (vLLM's
    `get_request_block_hasher`). Called with the request whenever tokens are
    appended; it hashes only real tokens, never async-scheduling placeholders.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def __call__(self, request: Request) -> list[BlockHash]:
        bs = self.block_size
        hashes = request.block_hashes
        start = len(hashes) * bs
        num_tokens = request.num_tokens
        if start + bs > num_tokens:
            return []
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else None
        new_hashes: list[BlockHash] = []
        while start + bs <= num_tokens:
            extra = request_extra_keys(request) if start == 0 else b""
            parent = hash_block_tokens(parent, tokens[start : start + bs], extra)
            new_hashes.append(parent)
            start += bs
        return new_hashes
