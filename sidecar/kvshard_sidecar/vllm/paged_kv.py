"""Reading token rows back out of vLLM's paged KV cache, in whichever layout the backend uses.

Why it exists. The connector's save path stores what vLLM computed (an item prefilled alone, a
history prefix) as a kvshard block, so it must read K/V rows for given cache slots. Writing is
layout-free — the attention backend's own ``do_kv_cache_update`` — but vLLM has no matching read, and
the layouts differ: the CPU backend keeps ``[blocks, kv_heads, block_size, 2 * head_dim]`` (keys in the
first half of each head's block, values in the second; its ``vec`` kernels store the keys
dimension-major), flash-attention ``[2, blocks, block_size,
kv_heads, head_dim]``, FlashInfer ``[blocks, 2, block_size, kv_heads, head_dim]``. Rather than trust a
shape, the connector *proves* a reader before it saves anything (:func:`choose_reader`): it writes a
probe through the backend into the null block (block 0, which vLLM never hands to a request), reads
it back with each candidate reader, and keeps the one that returns the probe exactly. A backend whose
cache packs rows some other way (an fp8 cache, an ISA-specific tiling) matches none, and the save
path then stays off with a log line instead of storing garbage.

Torch only; no vLLM import (tests drive the readers with plain tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Write = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``write(keys, values, slots)``: the backend's own cache write (``[tokens, kv_heads, head_dim]``)."""


@dataclass(frozen=True)
class PagedReader:
    """Reads ``[tokens, kv_heads, head_dim]`` keys and values at cache slots, for one layout."""

    name: str
    read: Callable[[torch.Tensor, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]
    """``read(kv_cache, slots, kv_heads, head_dim)`` → (keys, values)."""


def _cpu(cache: torch.Tensor, slots: torch.Tensor, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks, _, block_size, _ = cache.shape
    view = cache.view(blocks, heads, 2 * block_size, dim)
    index, offset = slots // block_size, slots % block_size
    keys = view[index, :, offset]  # [tokens, heads, dim]
    values = view[index, :, offset + block_size]
    return keys, values


def _cpu_keys_dim_major(cache: torch.Tensor, slots: torch.Tensor, heads: int, dim: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM-CPU's ``vec`` kernels: per block and head, keys ``[dim, block_size]`` (dimension-major, so a
    query's dot products run along contiguous tokens), then values ``[block_size, dim]``."""
    blocks, _, block_size, _ = cache.shape
    region = cache.reshape(blocks, heads, 2 * block_size * dim)
    index, offset = slots // block_size, slots % block_size
    keys = region[:, :, : block_size * dim].reshape(blocks, heads, dim, block_size)[index, :, :, offset]
    values = region[:, :, block_size * dim :].reshape(blocks, heads, block_size, dim)[index, :, offset]
    return keys, values


def _kv_first(cache: torch.Tensor, slots: torch.Tensor, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = cache.shape[2]
    index, offset = slots // block_size, slots % block_size
    return cache[0, index, offset], cache[1, index, offset]


def _blocks_first(cache: torch.Tensor, slots: torch.Tensor, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = cache.shape[2]
    index, offset = slots // block_size, slots % block_size
    return cache[index, 0, offset], cache[index, 1, offset]


def candidate_readers(cache: torch.Tensor, heads: int, dim: int) -> list[PagedReader]:
    """The readers whose layout fits ``cache``'s shape (the probe decides among them)."""
    shape = tuple(cache.shape)
    readers = []
    if len(shape) == 4 and shape[1] == heads and shape[3] == 2 * dim:
        readers.append(PagedReader("cpu [blocks, heads, block, 2*dim]", _cpu))
        readers.append(PagedReader("cpu vec [blocks, heads, (dim, block) + (block, dim)]", _cpu_keys_dim_major))
    if len(shape) == 5 and shape[0] == 2 and shape[3:] == (heads, dim):
        readers.append(PagedReader("[2, blocks, block, heads, dim]", _kv_first))
    if len(shape) == 5 and shape[1] == 2 and shape[3:] == (heads, dim):
        readers.append(PagedReader("[blocks, 2, block, heads, dim]", _blocks_first))
    return readers


def block_size_of(cache: torch.Tensor) -> int:
    """Tokens per cache block in every layout above (dimension 2)."""
    return int(cache.shape[2])


def choose_reader(cache: torch.Tensor, heads: int, dim: int, dtype: torch.dtype, write: Write) -> PagedReader | None:
    """The reader that returns exactly what ``write`` put into the null block, or ``None``.

    The probe fills every slot of block 0 with distinct values (the values rows differ from the keys
    rows), so a reader that swaps keys and values, heads and tokens, or blocks, fails it.
    """
    tokens = block_size_of(cache)
    slots = torch.arange(tokens, dtype=torch.int64, device=cache.device)
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(tokens, heads, dim, generator=generator).to(dtype=dtype, device=cache.device)
    values = torch.randn(tokens, heads, dim, generator=generator).to(dtype=dtype, device=cache.device)
    write(keys, values, slots)
    for reader in candidate_readers(cache, heads, dim):
        try:
            got_keys, got_values = reader.read(cache, slots, heads, dim)
        except (RuntimeError, IndexError):
            continue
        if got_keys.dtype == dtype and torch.equal(got_keys, keys) and torch.equal(got_values, values):
            return reader
    return None
