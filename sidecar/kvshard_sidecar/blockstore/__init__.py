"""The sidecar's KV block store: per-segment KV blocks in memory, on disk, and on peers.

Everything a caller needs is re-exported here; the modules behind it are small and layered:
``block`` (the unit) → ``codec`` (checked bytes) → ``memory`` / ``disk`` (tiers) → ``store``.
"""

from kvshard_sidecar.blockstore.block import KVBlock
from kvshard_sidecar.blockstore.codec import CorruptBlockError, decode_block, encode_block, verify_block
from kvshard_sidecar.blockstore.disk import DiskTier
from kvshard_sidecar.blockstore.memory import MemoryTier
from kvshard_sidecar.blockstore.stats import Tier, TierStats
from kvshard_sidecar.blockstore.store import BlockFetcher, BlockHit, BlockStore

__all__ = [
    "BlockFetcher",
    "BlockHit",
    "BlockStore",
    "CorruptBlockError",
    "DiskTier",
    "KVBlock",
    "MemoryTier",
    "Tier",
    "TierStats",
    "decode_block",
    "encode_block",
    "verify_block",
]
