"""Content-addressed item maps (schema 2) against a real etcd: a rebalance writes kilobytes, an
unchanged map is not read again, partial reads, pruning, and schema-1 generations still read."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator

import pytest

from kvshard import etcd_keys, etcd_store
from kvshard import item_map_schema as item_maps
from kvshard import placement_schema as ps
from kvshard_local.testing_servers import EtcdServer

pytestmark = pytest.mark.slow
_names = itertools.count()
MiB = 1 << 20
CLUSTERS = 40


def big_map(items: int = 300_000, shift: int = 0) -> dict[str, int]:
    """~5 MiB of item map."""
    return {f"item-{n:08d}": (n * 7 + shift) % CLUSTERS for n in range(items)}


def placement(generation: int, item_clusters: dict[str, int], turn: int = 0) -> ps.Placement:
    pods = ("pod-a", "pod-b", "pod-c")
    return ps.Placement(generation=generation, assignment={c: (pods[(c + turn) % 3],) for c in range(CLUSTERS)},
                        item_clusters=item_clusters, pods=pods, model="m")


@pytest.fixture
async def store(etcd_server: EtcdServer) -> AsyncIterator[etcd_store.EtcdStore]:
    async with etcd_server.store(timeout=10) as s:
        yield s


@pytest.fixture
async def reader(etcd_server: EtcdServer) -> AsyncIterator[etcd_store.EtcdStore]:
    async with etcd_server.store(timeout=10) as s:
        yield s


@pytest.fixture
def shard() -> tuple[str, str]:
    return "ns", f"maps-{next(_names)}"


def map_digests(keys: list[str]) -> set[str]:
    return {k.split("/itemmap/")[1].split("/")[0] for k in keys if "/itemmap/" in k}


async def test_a_rebalance_only_generation_writes_no_item_chunk(
        store: etcd_store.EtcdStore, shard: tuple[str, str]) -> None:
    first = placement(1, big_map())
    before = store.bytes_written
    await store.publish(*shard, first, expected=0)
    assert store.bytes_written - before > 4 * MiB
    keys = await store.keys(*shard)
    current = await store.read_current(*shard)
    assert current is not None and current == first
    moved = dataclasses.replace(current, generation=2, assignment=placement(2, {}, turn=1).assignment)
    before = store.bytes_written
    await store.publish(*shard, moved, expected=1)
    assert store.bytes_written - before < 16 * 1024  # the assignment and current: kilobytes
    after = await store.keys(*shard)
    assert {k for k in after if "/itemmap/" in k} == {k for k in keys if "/itemmap/" in k}
    assert not [k for k in after if "/items/" in k]


async def test_an_equal_map_in_a_new_object_is_not_written_again(
        store: etcd_store.EtcdStore, shard: tuple[str, str]) -> None:
    await store.publish(*shard, placement(1, big_map(50_000)), expected=0)
    before = store.bytes_written
    await store.publish(*shard, placement(2, big_map(50_000), turn=1), expected=1)  # equal content, new dict
    assert store.bytes_written - before < 16 * 1024


async def test_a_reader_reads_no_chunk_while_the_digest_is_unchanged(
        store: etcd_store.EtcdStore, reader: etcd_store.EtcdStore, shard: tuple[str, str]) -> None:
    items = big_map()
    await store.publish(*shard, placement(1, items), expected=0)
    first = await reader.read_current(*shard)
    assert first is not None and first.item_clusters == items
    await store.publish(*shard, placement(2, items, turn=1), expected=1)
    before = reader.bytes_read
    second = await reader.read_current(*shard)
    assert reader.bytes_read - before < 16 * 1024
    assert second == placement(2, items, turn=1)
    assert second.item_clusters is first.item_clusters  # the router reuses its item index on `is`
    changed = big_map(shift=1)
    await store.publish(*shard, placement(3, changed), expected=2)
    before = reader.bytes_read
    third = await reader.read_current(*shard)
    assert third is not None and third.item_clusters == changed
    assert reader.bytes_read - before > 4 * MiB


async def test_watchers_read_a_map_once(
        store: etcd_store.EtcdStore, reader: etcd_store.EtcdStore, shard: tuple[str, str]) -> None:
    items = big_map(100_000)
    await store.publish(*shard, placement(1, items), expected=0)
    seen: list[ps.Placement] = []
    reads: list[int] = []

    async def follow() -> None:
        async for p in reader.watch_current(*shard):
            seen.append(p)
            reads.append(reader.bytes_read)
            if len(seen) == 3:
                return

    task = asyncio.create_task(follow())
    while not seen:
        await asyncio.sleep(0.05)
    await store.publish(*shard, placement(2, items, turn=1), expected=1)
    await store.publish(*shard, placement(3, items, turn=2), expected=2)
    await asyncio.wait_for(task, 20)
    assert [p.generation for p in seen] == [1, 2, 3]
    assert all(p.item_clusters == items for p in seen)
    assert reads[2] - reads[0] < 32 * 1024


async def test_a_partial_read_returns_exactly_those_clusters_items(
        store: etcd_store.EtcdStore, reader: etcd_store.EtcdStore, shard: tuple[str, str]) -> None:
    items = big_map()
    await store.publish(*shard, placement(1, items), expected=0)
    wanted = {3, 17}
    before = reader.bytes_read
    got = await reader.read_current(*shard, clusters=wanted)
    assert got is not None
    assert got.item_clusters == {i: c for i, c in items.items() if c in wanted}
    assert got.assignment == placement(1, items).assignment
    assert reader.bytes_read - before < 3 * MiB  # only the chunks holding clusters 3 and 17
    own = await reader.read_current(*shard, clusters_of="pod-b")
    assert own is not None
    mine = set(own.clusters_of("pod-b"))
    assert own.item_clusters == {i: c for i, c in items.items() if c in mine}


async def test_a_pruned_generations_map_goes_only_when_nothing_names_it(
        store: etcd_store.EtcdStore, shard: tuple[str, str]) -> None:
    a, b, c = big_map(20_000), big_map(20_000, shift=1), big_map(20_000, shift=2)
    await store.publish(*shard, placement(1, a), expected=0)
    digest_a = map_digests(await store.keys(*shard))
    await store.publish(*shard, placement(2, b), expected=1)
    both = map_digests(await store.keys(*shard))
    assert len(both) == 2 and digest_a < both  # generations 1 and 2 are kept: so are their maps
    await store.publish(*shard, placement(3, b, turn=1), expected=2)
    assert map_digests(await store.keys(*shard)) == both - digest_a  # 1 pruned: a goes, b stays
    await store.publish(*shard, placement(4, c), expected=3)
    now = map_digests(await store.keys(*shard))
    assert len(now) == 2 and both - digest_a < now  # 3 still names b, 4 names c
    await store.publish(*shard, placement(5, c, turn=2), expected=4)
    last = map_digests(await store.keys(*shard))
    assert len(last) == 1 and not last & both
    assert await store.delete_all(*shard) > 0
    assert await store.keys(*shard) == []


async def test_a_schema_1_generation_still_reads(
        store: etcd_store.EtcdStore, reader: etcd_store.EtcdStore, shard: tuple[str, str]) -> None:
    old = placement(1, big_map(80_000))
    assignment, chunks = ps.encode(old)  # the previous release's writer
    assert len(chunks) > 1
    await store._call("put", store._kv.put(etcd_keys.assignment_key(*shard, 1), assignment, timeout=10))
    for i, chunk in enumerate(chunks):
        await store._call("put", store._kv.put(etcd_keys.items_key(*shard, 1, i), chunk, timeout=10))
    await store._call("put", store._kv.put(etcd_keys.current_key(*shard), "1", timeout=10))
    assert await reader.read_current(*shard) == old
    part = await reader.read_current(*shard, clusters={5})
    assert part is not None and part.item_clusters == {i: c for i, c in old.item_clusters.items() if c == 5}
    # The next publish writes schema 2; once generation 1 is pruned its own items go with it.
    await store.publish(*shard, placement(2, old.item_clusters, turn=1), expected=1)
    await store.publish(*shard, placement(3, old.item_clusters, turn=2), expected=2)
    keys = await store.keys(*shard)
    assert not [k for k in keys if "/items/" in k]
    assert await reader.read_current(*shard) == placement(3, old.item_clusters, turn=2)


def test_old_readers_refuse_schema_2_with_a_clear_message() -> None:
    value = ps.encode_assignment(placement(1, {"x": 0}), 0, item_map="ab" * 16)
    assert ps.decode_header(value).item_map == "ab" * 16
    with pytest.raises(ps.PlacementFormatError, match="item map"):
        ps.decode(value, [])


def test_item_map_digest_is_remembered_per_mapping_object() -> None:
    items = big_map(30_000)
    encoded = item_maps.encode_item_map(items)
    assert item_maps.known_digest(items) == encoded.digest
    assert item_maps.known_digest(dict(items)) is None
    assert item_maps.item_map_digest(dict(items)) == encoded.digest  # content-addressed
    assert all(len(c) <= ps.MAX_VALUE_BYTES for c in encoded.chunks)
    spans = encoded.manifest.clusters
    assert sum(s[2] for s in spans.values()) == len(items)


async def test_a_map_lost_before_the_publish_is_stored_again(
        store: etcd_store.EtcdStore, reader: etcd_store.EtcdStore, shard: tuple[str, str]) -> None:
    items = big_map(20_000)
    await store.publish(*shard, placement(1, items), expected=0)
    await store._delete_range("test", etcd_keys.item_map_prefix(*shard))  # e.g. a concurrent writer's prune
    await store.publish(*shard, placement(2, items, turn=1), expected=1)  # the digest is remembered: still checked
    assert await reader.read_current(*shard) == placement(2, items, turn=1)
