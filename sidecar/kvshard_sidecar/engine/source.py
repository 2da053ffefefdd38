"""Where the engine gets and puts blocks: a two-method protocol, not the block store itself.

The engine needs only ``get(key)`` and ``put(key, block)``; coding against this :class:`BlockSource`
protocol lets tests and benchmarks use the dict-backed :class:`MemoryBlockSource` while the sidecar
passes its tiered ``kvshard_sidecar.blockstore.BlockStore`` (memory → disk → peers), whose hits say
which tier served them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kvshard_sidecar.blockstore.block import KVBlock


class BlockHitLike(Protocol):
    """What a lookup returns: the block and the tier (a string or a string enum) that served it."""

    @property
    def block(self) -> KVBlock: ...

    @property
    def tier(self) -> Any: ...


class BlockSource(Protocol):
    """The slice of a block store the engine uses."""

    def get(self, key: str) -> BlockHitLike | None: ...

    def put(self, key: str, block: KVBlock) -> None: ...


def tier_name(tier: Any) -> str:
    """``"memory"`` for both ``"memory"`` and ``Tier.MEMORY`` (an enum whose value is ``"memory"``)."""
    return str(getattr(tier, "value", tier))


@dataclass(frozen=True)
class MemoryHit:
    block: KVBlock
    tier: str = "memory"


class MemoryBlockSource:
    """A dict of blocks (tests, benchmarks, the embedded engine without a store)."""

    def __init__(self) -> None:
        self.blocks: dict[str, KVBlock] = {}

    def get(self, key: str) -> MemoryHit | None:
        block = self.blocks.get(key)
        return MemoryHit(block) if block is not None else None

    def put(self, key: str, block: KVBlock) -> None:
        self.blocks[key] = block

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def nbytes(self) -> int:
        return sum(block.nbytes for block in self.blocks.values())
