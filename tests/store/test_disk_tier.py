"""The disk tier: atomic, verified, budgeted files that several processes can share."""

from __future__ import annotations

import json
import multiprocessing
import os
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import store_workers
from store_helpers import bit_equal, make_block, make_key

from kvshard_sidecar.blockstore import DiskTier, decode_block, encode_block

KEY = make_key("disk")
BLOCK_FILE_BYTES = len(encode_block(KEY, make_block()))


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[DiskTier]:
    with DiskTier(tmp_path / "blocks", budget_bytes=10**8) as disk:
        yield disk


def _disk_usage(root: Path) -> int:
    return sum(path.stat().st_size for path in root.glob("??/*.safetensors"))


def _leftovers(root: Path) -> list[Path]:
    return [path for path in root.glob("??/*") if not path.name.endswith(".safetensors")]


def test_round_trip_is_bit_exact_in_one_file_per_key(tier: DiskTier) -> None:
    block = make_block(tokens=7, seed=3)
    assert tier.put(KEY, block)
    got = tier.get(KEY)
    assert got is not None and bit_equal(got, block)
    assert tier.path_for(KEY) == tier.root / KEY[:2] / f"{KEY}.safetensors"
    assert list(tier.root.glob("??/*")) == [tier.path_for(KEY)]


def test_read_bytes_serves_the_verified_encoding(tier: DiskTier) -> None:
    block = make_block()
    tier.put(KEY, block)
    data = tier.read_bytes(KEY)
    assert data == tier.path_for(KEY).read_bytes()
    assert bit_equal(decode_block(KEY, data), block)
    assert tier.read_bytes(make_key("absent")) is None


def _flip_data_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(data)


def _flip_header_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8 + data[8:].index(b'"shape"') + 9] ^= 0x01  # inside the first shape
    path.write_bytes(data)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(BLOCK_FILE_BYTES))


def _wrong_block(path: Path) -> None:
    path.write_bytes(encode_block(make_key("someone else"), make_block()))


DAMAGES: dict[str, Callable[[Path], None]] = {
    "flipped data byte": _flip_data_byte,
    "flipped header byte": _flip_header_byte,
    "truncated": _truncate,
    "garbage": _garbage,
    "another key's block": _wrong_block,
}


@pytest.mark.parametrize("damage", DAMAGES.values(), ids=list(DAMAGES))
@pytest.mark.parametrize("read", ["get", "read_bytes"])
def test_a_damaged_file_is_a_corrupt_miss_and_is_removed(
    tier: DiskTier, damage: Callable[[Path], None], read: str
) -> None:
    tier.put(KEY, make_block())
    tier.put(make_key("neighbour"), make_block())
    damage(tier.path_for(KEY))
    assert getattr(tier, read)(KEY) is None
    assert not tier.path_for(KEY).exists()
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.corrupt) == (0, 1, 1)
    assert (stats.bytes, stats.entries) == (_disk_usage(tier.root), 1)
    assert getattr(tier, read)(KEY) is None  # now a plain miss
    assert tier.stats().corrupt == 1


def test_a_corrupt_file_replaced_by_another_writer_is_not_removed(tier: DiskTier) -> None:
    tier.put(KEY, make_block())
    path = tier.path_for(KEY)
    _garbage(path)
    tier.put(KEY, make_block())  # a fresh, valid file takes the path before the reader drops it
    fresh = os.stat(path)
    tier._drop_corrupt(path, (0, 0))  # the reader saw another inode
    assert path.exists() and os.stat(path).st_ino == fresh.st_ino
    assert tier.get(KEY) is not None


@pytest.mark.parametrize(
    "bad_key", ["", "../../etc/passwd", "a" * 63, "A" * 64, "a" * 62 + "/x", "a" * 64 + ".safetensors"]
)
def test_keys_that_are_not_block_keys_are_rejected(tier: DiskTier, bad_key: str) -> None:
    for call in (tier.get, tier.read_bytes, tier.contains, tier.evict, tier.path_for):
        with pytest.raises(ValueError):
            call(bad_key)
    with pytest.raises(ValueError):
        tier.put(bad_key, make_block())
    assert list(tier.root.iterdir()) == [tier.root / ".lock"]


def test_budget_evicts_the_least_recently_read_file(tmp_path: Path) -> None:
    keys = [make_key(n) for n in range(4)]
    with DiskTier(tmp_path, budget_bytes=3 * BLOCK_FILE_BYTES, low_water=1.0) as tier:
        for key in keys[:3]:
            tier.put(key, make_block())
        assert tier.get(keys[0]) is not None  # touch: keys[1] is now the oldest
        tier.put(keys[3], make_block())
        assert [tier.contains(k) for k in keys] == [True, False, True, True]
        stats = tier.stats()
        assert stats.evictions == 1 and stats.bytes == _disk_usage(tmp_path) <= 3 * BLOCK_FILE_BYTES


def test_eviction_frees_down_to_the_low_water_mark_oldest_first(tmp_path: Path) -> None:
    keys = [make_key(n) for n in range(10)]
    with DiskTier(tmp_path, budget_bytes=10 * BLOCK_FILE_BYTES, low_water=0.7) as tier:
        for key in keys:
            tier.put(key, make_block())
        tier.put(make_key("one more"), make_block())
        assert [tier.contains(k) for k in keys] == [False] * 4 + [True] * 6
        assert tier.stats().bytes == 7 * BLOCK_FILE_BYTES


def test_a_block_bigger_than_the_whole_budget_is_not_written(tmp_path: Path) -> None:
    with DiskTier(tmp_path, budget_bytes=BLOCK_FILE_BYTES - 1) as tier:
        assert not tier.put(KEY, make_block())
        assert not tier.contains(KEY) and tier.stats().bytes == 0


def test_budget_is_honoured_across_two_tiers_sharing_a_folder(tmp_path: Path) -> None:
    budget = 5 * BLOCK_FILE_BYTES
    with DiskTier(tmp_path, budget) as first, DiskTier(tmp_path, budget) as second:
        for n in range(20):
            (first if n % 2 else second).put(make_key(n), make_block(seed=n))
            assert _disk_usage(tmp_path) <= budget
        assert first.stats().bytes == second.stats().bytes == _disk_usage(tmp_path)
        assert first.stats().evictions + second.stats().evictions == 20 - first.stats().entries
        assert {k for k in first.keys()} == {k for k in second.keys()}


def test_usage_is_recounted_when_a_tier_opens(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 10**8) as tier:
        for n in range(3):
            tier.put(make_key(n), make_block())
    os.pwrite(os.open(tmp_path / ".lock", os.O_RDWR), struct.pack("<QQ", 1, 99), 0)  # skewed totals
    with DiskTier(tmp_path, 10**8) as reopened:
        stats = reopened.stats()
        assert (stats.bytes, stats.entries) == (3 * BLOCK_FILE_BYTES, 3)
        assert sorted(reopened.keys()) == sorted(make_key(n) for n in range(3))


def test_evict_removes_the_file_and_its_bytes(tier: DiskTier) -> None:
    tier.put(KEY, make_block())
    assert tier.evict(KEY) and not tier.evict(KEY)
    stats = tier.stats()
    assert (stats.bytes, stats.entries, stats.evictions) == (0, 0, 0)


def test_stats_count_hits_and_misses(tier: DiskTier) -> None:
    tier.put(KEY, make_block())
    tier.get(KEY)
    tier.read_bytes(KEY)
    tier.get(make_key("absent"))
    assert tier.contains(KEY)  # not a lookup
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.corrupt, stats.entries) == (2, 1, 0, 1)
    assert stats.bytes == BLOCK_FILE_BYTES


def test_concurrent_threads_writing_one_key_leave_one_valid_file(tier: DiskTier) -> None:
    blocks = [make_block(seed=n) for n in range(4)]
    threads = [threading.Thread(target=lambda b=b: [tier.put(KEY, b) for _ in range(25)]) for b in blocks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert list(tier.root.glob("??/*")) == [tier.path_for(KEY)]
    got = tier.get(KEY)
    assert got is not None and any(bit_equal(got, b) for b in blocks)
    assert (tier.stats().entries, tier.stats().bytes) == (1, BLOCK_FILE_BYTES)


@pytest.fixture(scope="module")
def pool() -> Iterator[multiprocessing.pool.Pool]:
    with multiprocessing.get_context("spawn").Pool(3) as workers:
        yield workers


def test_concurrent_writer_processes_of_one_key_leave_one_valid_file(
    pool: multiprocessing.pool.Pool, tmp_path: Path
) -> None:
    key = make_key("contended")
    jobs = [(str(tmp_path), key, seed, 30) for seed in range(3)]
    written = pool.starmap(store_workers.write_same_key, jobs)
    assert written == [30, 30, 30]
    files = list(tmp_path.glob("??/*"))
    assert files == [tmp_path / key[:2] / f"{key}.safetensors"]
    decoded = decode_block(key, files[0].read_bytes())
    assert any(bit_equal(decoded, make_block(tokens=16, seed=seed)) for seed in range(3))
    with DiskTier(tmp_path, 10**9) as tier:
        assert (tier.stats().entries, tier.stats().bytes) == (1, files[0].stat().st_size)
    header_len = struct.unpack_from("<Q", files[0].read_bytes())[0]
    assert json.loads(files[0].read_bytes()[8 : 8 + header_len])["__metadata__"]["block_key"] == key


def test_budget_is_honoured_across_writer_processes(pool: multiprocessing.pool.Pool, tmp_path: Path) -> None:
    budget = 6 * BLOCK_FILE_BYTES
    jobs = [(str(tmp_path), [make_key((worker, n)) for n in range(15)], budget) for worker in range(3)]
    evictions = sum(pool.starmap(store_workers.write_many_keys, jobs))
    usage = _disk_usage(tmp_path)
    assert usage <= budget and not _leftovers(tmp_path)
    with DiskTier(tmp_path, budget) as tier:
        stats = tier.stats()
        assert stats.bytes == usage and stats.entries == 45 - evictions
        assert all(tier.get(key) is not None for key in list(tier.keys()))


def test_temp_files_of_dead_writers_are_cleaned_up_but_live_ones_kept(tmp_path: Path) -> None:
    shard = tmp_path / KEY[:2]
    shard.mkdir()
    stale, live = shard / f".{KEY}.dead.tmp", shard / f".{KEY}.writing.tmp"
    stale.write_bytes(b"partial")
    live.write_bytes(b"partial")
    os.utime(stale, (1, 1))
    with DiskTier(tmp_path, 10**8) as tier:
        assert not stale.exists() and live.exists()
        assert (tier.stats().bytes, tier.stats().entries, list(tier.keys())) == (0, 0, [])
