"""Small random blocks and keys for the block-store tests (no model needed)."""

from __future__ import annotations

import hashlib

import torch

from kvshard_sidecar.blockstore import KVBlock


def make_key(name: object) -> str:
    """A valid block key derived from ``name`` (stable across runs)."""
    return hashlib.blake2b(repr(name).encode(), digest_size=32).hexdigest()


def make_block(tokens: int = 4, dtype: torch.dtype = torch.float32, seed: int = 0) -> KVBlock:
    """A random block of shape ``[2, 3, tokens, 8]``."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, 3, tokens, 8)
    keys = torch.randn(shape, generator=generator).to(dtype)
    values = torch.randn(shape, generator=generator).to(dtype)
    return KVBlock(keys=keys, values=values)


def bit_equal(a: KVBlock, b: KVBlock) -> bool:
    """Same dtype, shape and bytes (NaN-safe, unlike ``torch.equal``)."""
    return all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in ((a.keys, b.keys), (a.values, b.values))
    )
