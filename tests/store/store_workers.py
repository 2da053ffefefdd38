"""Functions the multi-process disk-tier tests run in spawned processes (importable by name)."""

from __future__ import annotations

from pathlib import Path

from store_helpers import make_block

from kvshard_sidecar.blockstore import DiskTier


def write_same_key(root: str, key: str, seed: int, rounds: int) -> int:
    """Put ``key`` ``rounds`` times (each writer with its own content); returns how many succeeded."""
    tier = DiskTier(Path(root), budget_bytes=10**9)
    written = sum(tier.put(key, make_block(tokens=16, seed=seed)) for _ in range(rounds))
    tier.close()
    return written


def write_many_keys(root: str, keys: list[str], budget_bytes: int) -> int:
    """Put one block per key under a small shared budget; returns this process's evictions."""
    tier = DiskTier(Path(root), budget_bytes=budget_bytes)
    for index, key in enumerate(keys):
        tier.put(key, make_block(tokens=4, seed=index))
    evictions = tier.stats().evictions
    tier.close()
    return evictions
