"""Item maps stored as deltas (issue 41): a catalog change that moves a few items writes and reads
bytes in proportion to what changed; readers without the base rebuild the exact map; chains are
bounded; pruning keeps every base a kept delta needs."""

from __future__ import annotations

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


def big_map(items: int = 200_000) -> dict[str, int]:
    return {f"item-{n:08d}": (n * 7) % CLUSTERS for n in range(items)}


def relabelled(items: dict[str, int], fraction: float, salt: int = 0, *, add: int = 0, remove: int = 0
               ) -> dict[str, int]:
    """A copy with every ``1/fraction``-th item moved to another cluster (and items added/removed)."""
    out = dict(items)
    step = max(1, int(1 / fraction))
    for n, item in enumerate(items):
        if (n + salt) % step == 0:
            out[item] = (out[item] + 1 + salt) % CLUSTERS
    for n in range(remove):
        out.pop(f"item-{n * 3 + salt:08d}", None)
    for n in range(add):
        out[f"new-{salt}-{n:06d}"] = n % CLUSTERS
    return out


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
async def fresh(etcd_server: EtcdServer) -> AsyncIterator[etcd_store.EtcdStore]:
    async with etcd_server.store(timeout=10) as s:
        yield s


@pytest.fixture
def shard() -> tuple[str, str]:
    return "ns", f"deltas-{next(_names)}"


def map_digests(keys: list[str]) -> set[str]:
    return {k.split("/itemmap/")[1].split("/")[0] for k in keys if "/itemmap/" in k}


async def manifest(store: etcd_store.EtcdStore, shard: tuple[str, str], digest: str) -> item_maps.ItemMapManifest:
    got = await store._call("read", store._kv.get(etcd_keys.item_map_manifest_key(*shard, digest), timeout=10))
    return item_maps.decode_item_map_manifest(bytes(got.kvs[0].value))


async def test_a_one_percent_catalog_change_writes_and_reads_only_the_changes(
        store: etcd_store.EtcdStore, reader: etcd_store.EtcdStore, fresh: etcd_store.EtcdStore,
        shard: tuple[str, str]) -> None:
    items = big_map()
    before = store.bytes_written
    await store.publish(*shard, placement(1, items), expected=0)
    full = store.bytes_written - before
    assert full > 2 * MiB
    first = await reader.read_current(*shard)
    assert first is not None and first.item_clusters == items
    changed = relabelled(items, 0.01, add=500, remove=300)
    before = store.bytes_written
    await store.publish(*shard, placement(2, changed, turn=1), expected=1)
    assert store.bytes_written - before < 0.05 * full
    digest = item_maps.encode_item_map(changed).digest  # still the digest of the full content
    stored = await manifest(store, shard, digest)
    assert stored.base == item_maps.encode_item_map(items).digest and stored.depth == 1
    before = reader.bytes_read
    second = await reader.read_current(*shard)
    assert second is not None and second.item_clusters == changed and second == placement(2, changed, turn=1)
    assert reader.bytes_read - before < 0.05 * full  # it had the base: only the delta
    rebuilt = await fresh.read_current(*shard)  # never read anything: base + delta
    assert rebuilt is not None and rebuilt.item_clusters == changed
    # Unchanged digest: nothing read again, the same object handed out.
    await store.publish(*shard, dataclasses.replace(placement(3, changed), item_clusters=second.item_clusters),
                        expected=2)
    before = reader.bytes_read
    third = await reader.read_current(*shard)
    assert third is not None and third.item_clusters is second.item_clusters
    assert reader.bytes_read - before < 16 * 1024


async def test_partial_reads_of_a_delta_are_exact(
        store: etcd_store.EtcdStore, reader: etcd_store.EtcdStore, fresh: etcd_store.EtcdStore,
        shard: tuple[str, str]) -> None:
    items = big_map(60_000)
    await store.publish(*shard, placement(1, items), expected=0)
    wanted = {3, 4, 17}
    part = await reader.read_current(*shard, clusters=wanted)
    assert part is not None and part.item_clusters == {i: c for i, c in items.items() if c in wanted}
    maps = [items]
    for g in range(2, 5):
        maps.append(relabelled(maps[-1], 0.02, salt=g, add=50, remove=40))
        await store.publish(*shard, placement(g, maps[-1], turn=g), expected=g - 1)
        for r in (reader, fresh):
            got = await r.read_current(*shard, clusters=wanted)
            assert got is not None and got.item_clusters == {i: c for i, c in maps[-1].items() if c in wanted}
        own = await reader.read_current(*shard, clusters_of="pod-b")
        assert own is not None
        mine = set(own.clusters_of("pod-b"))
        assert own.item_clusters == {i: c for i, c in maps[-1].items() if c in mine}
    whole = await reader.read_current(*shard)
    assert whole is not None and whole.item_clusters == maps[-1]


async def test_a_chain_longer_than_the_bound_is_written_full(
        store: etcd_store.EtcdStore, fresh: etcd_store.EtcdStore, shard: tuple[str, str]) -> None:
    maps = [big_map(20_000)]
    await store.publish(*shard, placement(1, maps[0]), expected=0)
    depths = []
    for g in range(2, item_maps.MAX_DELTA_DEPTH + 4):
        maps.append(relabelled(maps[-1], 0.01, salt=g))
        await store.publish(*shard, placement(g, maps[-1]), expected=g - 1)
        depths.append((await manifest(store, shard, item_maps.encode_item_map(maps[-1]).digest)).depth)
    assert depths[:item_maps.MAX_DELTA_DEPTH] == list(range(1, item_maps.MAX_DELTA_DEPTH + 1))
    assert depths[item_maps.MAX_DELTA_DEPTH] == 0  # full again
    assert depths[item_maps.MAX_DELTA_DEPTH + 1] == 1
    got = await fresh.read_current(*shard)
    assert got is not None and got.item_clusters == maps[-1]


async def test_a_big_change_is_written_full(store: etcd_store.EtcdStore, shard: tuple[str, str]) -> None:
    items = big_map(20_000)
    await store.publish(*shard, placement(1, items), expected=0)
    changed = relabelled(items, 0.5)
    await store.publish(*shard, placement(2, changed), expected=1)
    assert not (await manifest(store, shard, item_maps.encode_item_map(changed).digest)).is_delta


async def test_pruning_keeps_a_base_while_a_kept_delta_needs_it(
        store: etcd_store.EtcdStore, fresh: etcd_store.EtcdStore, shard: tuple[str, str]) -> None:
    a = big_map(20_000)
    b = relabelled(a, 0.01, salt=1)
    c = relabelled(b, 0.01, salt=2)
    digest = {k: item_maps.encode_item_map(v).digest for k, v in {"a": a, "b": b, "c": c}.items()}
    await store.publish(*shard, placement(1, a), expected=0)
    await store.publish(*shard, placement(2, b), expected=1)  # b = a + delta
    await store.publish(*shard, placement(3, b, turn=1), expected=2)  # generation 1 (naming a) pruned
    assert map_digests(await store.keys(*shard)) == {digest["a"], digest["b"]}  # b's chain needs a
    await store.publish(*shard, placement(4, c), expected=3)  # c = b + delta = a + 2 deltas
    await store.publish(*shard, placement(5, c, turn=2), expected=4)  # no generation names a or b
    assert map_digests(await store.keys(*shard)) == {digest[k] for k in "abc"}  # c's chain
    got = await fresh.read_current(*shard)
    assert got is not None and got.item_clusters == c
    d = relabelled(c, 0.5, salt=3)  # written full
    await store.publish(*shard, placement(6, d), expected=5)
    await store.publish(*shard, placement(7, d, turn=1), expected=6)
    assert map_digests(await store.keys(*shard)) == {item_maps.encode_item_map(d).digest}  # nothing needs a, b, c


async def test_a_rebalance_after_a_delta_writes_no_chunk(
        store: etcd_store.EtcdStore, shard: tuple[str, str]) -> None:
    items = big_map(50_000)
    await store.publish(*shard, placement(1, items), expected=0)
    changed = relabelled(items, 0.01)
    await store.publish(*shard, placement(2, changed), expected=1)
    current = await store.read_current(*shard)
    assert current is not None and current.item_clusters is changed  # the store holds what it published
    before = store.bytes_written
    await store.publish(*shard, dataclasses.replace(current, generation=3, assignment=placement(3, {}, 1).assignment),
                        expected=2)
    assert store.bytes_written - before < 16 * 1024


def test_item_map_changes_and_delta_encoding() -> None:
    base = big_map(5_000)
    new = relabelled(base, 0.1, add=7, remove=9)
    changes = item_maps.item_map_changes(base, new)
    assert changes is not None
    assert sum(1 for c in changes.values() if c is None) == 9
    assert item_maps.apply_item_map_changes(dict(base), changes) == new
    assert item_maps.item_map_changes(base, new, limit=10) is None
    assert item_maps.item_map_changes(base, base) == {}
    full = item_maps.encode_item_map(new)
    delta = item_maps.encode_item_map_delta(full, item_maps.encode_item_map(base).manifest, changes)
    assert delta.digest == full.digest and delta.manifest.depth == 1
    decoded: dict[str, int | None] = {}
    for chunk in delta.chunks:
        decoded.update(item_maps.decode_item_map_delta_chunk(chunk))
    assert decoded == changes
    assert item_maps.decode_item_map_manifest(delta.manifest.encode()) == delta.manifest
    with pytest.raises(ps.PlacementFormatError):
        item_maps.decode_item_map_chunk(delta.chunks[0])  # a full-map reader refuses a delta's chunk


def test_a_big_delta_is_split_into_chunks_under_the_limit() -> None:
    base = big_map(300_000)
    new = relabelled(base, 0.2, add=20_000, remove=50_000)
    changes = item_maps.item_map_changes(base, new)
    assert changes is not None
    delta = item_maps.encode_item_map_delta(item_maps.encode_item_map(new), item_maps.encode_item_map(base).manifest,
                                            changes)
    assert len(delta.chunks) > 1 and all(len(c) <= ps.MAX_VALUE_BYTES for c in delta.chunks)
    decoded: dict[str, int | None] = {}
    for chunk in delta.chunks:
        decoded.update(item_maps.decode_item_map_delta_chunk(chunk))
    assert item_maps.apply_item_map_changes(dict(base), decoded) == new
