"""The block store: memory over disk over a fetcher, one get/put/contains/evict/stats."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from store_helpers import bit_equal, make_block, make_key

from kvshard.segments import ModelIdentity, Segment, SegmentKind, block_key
from kvshard_sidecar.blockstore import BlockStore, CorruptBlockError, KVBlock, TierStats

KEY = make_key("store")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BlockStore]:
    blocks = BlockStore(memory_bytes=10**7, disk_root=tmp_path, disk_bytes=10**8)
    yield blocks
    blocks.close()


def test_a_put_block_is_served_from_memory(store: BlockStore) -> None:
    block = make_block()
    store.put(KEY, block)
    hit = store.get(KEY)
    assert hit is not None and hit.tier == "memory" and hit.block is block


def test_a_block_keyed_by_its_segment_round_trips_through_disk(tmp_path: Path) -> None:
    identity = ModelIdentity("SmolLM2-135M-Instruct", revision="r1", tokenizer="t1")
    key = block_key(identity, Segment(SegmentKind.ITEM, (17, 42, 99)))
    block = make_block(tokens=3, seed=7)
    with_disk = BlockStore(memory_bytes=10**7, disk_root=tmp_path, disk_bytes=10**8)
    with_disk.put(key, block)
    with_disk.close()
    cold = BlockStore(memory_bytes=10**7, disk_root=tmp_path, disk_bytes=10**8)  # e.g. a restart
    first, second = cold.get(key), cold.get(key)
    assert first is not None and first.tier == "disk" and bit_equal(first.block, block)
    assert second is not None and second.tier == "memory"  # promoted
    cold.close()


def test_a_miss_everywhere_is_none_and_counted_in_every_tier(store: BlockStore) -> None:
    assert store.get(KEY) is None
    stats = store.stats()
    assert set(stats) == {"memory", "disk"}
    assert stats["memory"].misses == stats["disk"].misses == 1


def test_contains_names_the_nearest_tier_without_counting(tmp_path: Path) -> None:
    block = make_block()
    store = BlockStore(memory_bytes=block.nbytes, disk_root=tmp_path, disk_bytes=10**8)
    store.put(KEY, block)
    assert store.contains(KEY) == "memory"
    store.put(make_key("pushes the first out of memory"), block)
    assert store.contains(KEY) == "disk"
    assert store.contains(make_key("absent")) is None
    assert all((s.hits, s.misses) == (0, 0) for s in store.stats().values())
    store.close()


def test_evict_removes_a_block_from_every_tier(store: BlockStore) -> None:
    store.put(KEY, make_block())
    assert store.evict(KEY)
    assert store.contains(KEY) is None and store.get(KEY) is None
    assert not store.evict(KEY)


def test_stats_count_hits_misses_bytes_and_entries_per_tier(tmp_path: Path) -> None:
    block = make_block()
    store = BlockStore(memory_bytes=2 * block.nbytes, disk_root=tmp_path, disk_bytes=10**8)
    keys = [make_key(n) for n in range(3)]
    for key in keys:
        store.put(key, block)  # memory keeps the last two; disk keeps all three
    assert store.get(keys[2]) is not None  # memory hit
    assert store.get(keys[0]) is not None  # memory miss, disk hit, promoted (evicts keys[1])
    assert store.get(make_key("absent")) is None  # miss in both
    stats = store.stats()
    memory, disk = stats["memory"], stats["disk"]
    assert (memory.hits, memory.misses, memory.evictions, memory.entries) == (1, 2, 2, 2)
    assert memory.bytes == 2 * block.nbytes
    assert (disk.hits, disk.misses, disk.evictions, disk.corrupt, disk.entries) == (1, 1, 0, 0, 3)
    assert disk.bytes == sum(p.stat().st_size for p in tmp_path.glob("??/*.safetensors"))
    store.close()


def test_a_corrupt_disk_block_is_a_miss_counted_as_corrupt(tmp_path: Path) -> None:
    store = BlockStore(memory_bytes=0, disk_root=tmp_path, disk_bytes=10**8)
    store.put(KEY, make_block())
    path = tmp_path / KEY[:2] / f"{KEY}.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(data)
    assert store.get(KEY) is None
    assert store.stats()["disk"].corrupt == 1 and not path.exists()
    store.close()


def test_a_memory_only_store_reports_only_memory() -> None:
    store = BlockStore(memory_bytes=10**6)
    store.put(KEY, make_block())
    hit = store.get(KEY)
    assert hit is not None and hit.tier == "memory"
    assert list(store.stats()) == ["memory"]


def test_a_fetched_block_is_reported_as_peer_and_kept_locally(tmp_path: Path) -> None:
    remote = {KEY: make_block(seed=5)}
    asked: list[str] = []

    def fetch(key: str) -> KVBlock | None:
        asked.append(key)
        return remote.get(key)

    store = BlockStore(memory_bytes=10**6, disk_root=tmp_path, disk_bytes=10**8, fetcher=fetch)
    first, second = store.get(KEY), store.get(KEY)
    assert first is not None and first.tier == "peer" and bit_equal(first.block, remote[KEY])
    assert second is not None and second.tier == "memory"
    assert store.contains(KEY) == "memory" and (tmp_path / KEY[:2] / f"{KEY}.safetensors").exists()
    assert store.get(make_key("nobody has it")) is None
    assert asked == [KEY, make_key("nobody has it")]
    assert store.stats()["peer"] == TierStats(hits=1, misses=1)
    store.close()


def test_a_corrupt_fetch_is_a_miss_counted_as_corrupt() -> None:
    def fetch(key: str) -> KVBlock | None:
        raise CorruptBlockError("checksum mismatch")

    store = BlockStore(memory_bytes=10**6, fetcher=fetch)
    assert store.get(KEY) is None
    assert store.stats()["peer"] == TierStats(misses=1, corrupt=1)
