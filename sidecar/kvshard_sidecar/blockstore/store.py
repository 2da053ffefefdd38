"""The block store: one ``get``/``put`` over the memory tier, the disk tier and a miss fetcher.

Lookups go memory → disk → fetcher. A disk hit is promoted to memory, and a fetched block is kept
in both local tiers, so the next lookup is a memory hit. The fetcher is the seam for the peer tier
(``kvshard_sidecar.blockstore.peers.PeerFetcher`` asks the pods that hold the block over HTTP and decodes with
the codec); this module knows nothing about networking. A fetcher that raises :class:`CorruptBlockError` is
counted as a corrupt miss, so a peer's damaged reply is never served.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvshard_sidecar.blockstore.block import KVBlock
from kvshard_sidecar.blockstore.codec import CorruptBlockError
from kvshard_sidecar.blockstore.disk import DiskTier
from kvshard_sidecar.blockstore.memory import MemoryTier
from kvshard_sidecar.blockstore.stats import Tier, TierStats

BlockFetcher = Callable[[str], KVBlock | None]
"""Looks a key up beyond the local tiers (e.g. on a peer); ``None`` when nobody has it."""


@dataclass(frozen=True)
class BlockHit:
    """A found block and the tier that served it."""

    block: KVBlock
    tier: Tier


class BlockStore:
    """Memory (LRU) over optional disk over an optional fetcher, each with a byte budget.

    ``disk_root=None`` runs memory-only (tests, the demo without a cache folder).
    """

    def __init__(
        self,
        memory_bytes: int,
        disk_root: Path | None = None,
        disk_bytes: int = 0,
        fetcher: BlockFetcher | None = None,
    ) -> None:
        self.memory = MemoryTier(memory_bytes)
        self.disk = DiskTier(disk_root, disk_bytes) if disk_root is not None else None
        self._fetcher = fetcher
        self._fetch_lock = threading.Lock()
        self._fetch_hits = self._fetch_misses = self._fetch_corrupt = 0

    def get(self, key: str) -> BlockHit | None:
        """The block for ``key`` from the nearest tier that has it, or ``None``."""
        block = self.memory.get(key)
        if block is not None:
            return BlockHit(block, "memory")
        if self.disk is not None:
            block = self.disk.get(key)
            if block is not None:
                self.memory.put(key, block)
                return BlockHit(block, "disk")
        if self._fetcher is not None:
            block = self._fetch(key, self._fetcher)
            if block is not None:
                self.memory.put(key, block)
                if self.disk is not None:
                    self.disk.put(key, block)
                return BlockHit(block, "peer")
        return None

    def put(self, key: str, block: KVBlock) -> None:
        """Store ``block`` in every local tier (each keeps it if it fits its budget)."""
        if self.disk is not None:
            self.disk.put(key, block)
        self.memory.put(key, block)

    def contains(self, key: str) -> Tier | None:
        """The nearest local tier holding ``key``, without counting a lookup or touching LRU order."""
        if self.memory.contains(key):
            return "memory"
        if self.disk is not None and self.disk.contains(key):
            return "disk"
        return None

    def evict(self, key: str) -> bool:
        """Drop ``key`` from every local tier; ``True`` if any held it."""
        in_memory = self.memory.evict(key)
        on_disk = self.disk.evict(key) if self.disk is not None else False
        return in_memory or on_disk

    def stats(self) -> dict[str, TierStats]:
        """Per-tier counters, keyed by tier name (``"peer"`` only when a fetcher is set)."""
        stats = {"memory": self.memory.stats()}
        if self.disk is not None:
            stats["disk"] = self.disk.stats()
        if self._fetcher is not None:
            with self._fetch_lock:
                stats["peer"] = TierStats(
                    hits=self._fetch_hits, misses=self._fetch_misses, corrupt=self._fetch_corrupt
                )
        return stats

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def _fetch(self, key: str, fetcher: BlockFetcher) -> KVBlock | None:
        try:
            block = fetcher(key)
        except CorruptBlockError:
            block, corrupt = None, 1
        else:
            corrupt = 0
        with self._fetch_lock:
            if block is None:
                self._fetch_misses += 1
            else:
                self._fetch_hits += 1
            self._fetch_corrupt += corrupt
        return block
