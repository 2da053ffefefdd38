"""Names and counters shared by every tier of the block store.

They live apart from the tiers so the memory tier, the disk tier, the store, the peer
tier and the metrics exporter all speak the same vocabulary without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Tier = Literal["memory", "disk", "peer"]
"""Where a block was found. ``"peer"`` is only ever reported through the store's fetcher seam."""


@dataclass(frozen=True)
class TierStats:
    """A snapshot of one tier's counters.

    ``misses`` counts every lookup that was not served, corrupt ones included; ``corrupt`` counts
    the lookups that found a block failing its checksum (it was dropped, never served).
    ``evictions`` counts blocks dropped to stay within the byte budget, not explicit ``evict``
    calls. ``bytes`` and ``entries`` describe what the tier holds now.
    """

    hits: int = 0
    misses: int = 0
    bytes: int = 0
    evictions: int = 0
    corrupt: int = 0
    entries: int = 0
