"""The memory tier: the hottest blocks, kept as live tensors under a byte budget.

Blocks are served as the very tensors that were put (no copy), so a hit costs a dict lookup. An
``OrderedDict`` gives LRU order in O(1); one lock makes it safe for the sidecar's request threads.
The budget is a hard ceiling: a put evicts least-recently-used blocks until the new one fits, and a
block larger than the whole budget is simply not stored.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator

from kvshard_sidecar.blockstore.block import KVBlock
from kvshard_sidecar.blockstore.stats import TierStats


class MemoryTier:
    """An LRU of blocks bounded by ``budget_bytes`` (``KVBlock.nbytes`` summed)."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self._blocks: OrderedDict[str, KVBlock] = OrderedDict()
        self._lock = threading.Lock()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0

    def get(self, key: str) -> KVBlock | None:
        """The block for ``key`` (now the most recently used), or ``None``; counts a hit or miss."""
        with self._lock:
            block = self._blocks.get(key)
            if block is None:
                self._misses += 1
                return None
            self._blocks.move_to_end(key)
            self._hits += 1
            return block

    def put(self, key: str, block: KVBlock) -> bool:
        """Store ``block``, evicting LRU blocks to fit; ``False`` if it exceeds the whole budget."""
        size = block.nbytes
        if size > self.budget_bytes:
            return False
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            while self._bytes + size > self.budget_bytes:
                _, evicted = self._blocks.popitem(last=False)
                self._bytes -= evicted.nbytes
                self._evictions += 1
            self._blocks[key] = block
            self._bytes += size
            return True

    def contains(self, key: str) -> bool:
        """Whether ``key`` is held; neither counts nor changes LRU order."""
        with self._lock:
            return key in self._blocks

    def evict(self, key: str) -> bool:
        """Drop ``key``; ``True`` if it was held. Not counted as an eviction (that is budget-driven)."""
        with self._lock:
            block = self._blocks.pop(key, None)
            if block is None:
                return False
            self._bytes -= block.nbytes
            return True

    def keys(self) -> Iterator[str]:
        """The held keys, least recently used first (a snapshot)."""
        with self._lock:
            return iter(list(self._blocks))

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                hits=self._hits,
                misses=self._misses,
                bytes=self._bytes,
                evictions=self._evictions,
                entries=len(self._blocks),
            )
