"""Placement publishing against a real etcd: atomic generations, CAS, watch, heat, cleanup."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator

import pytest

from kvshard import etcd_keys, etcd_store
from kvshard import placement_schema as ps
from kvshard_local.testing_servers import EtcdServer

pytestmark = pytest.mark.slow
_names = itertools.count()


def placement(generation: int, items: int = 20) -> ps.Placement:
    return ps.Placement(
        generation=generation,
        assignment={0: ("pod-a",), 1: ("pod-b",), 2: ("pod-a", "pod-b")},
        item_clusters={f"i{n}": n % 3 for n in range(items)},
        pods=("pod-a", "pod-b"),
        model="m",
    )


@pytest.fixture
async def store(etcd_server: EtcdServer) -> AsyncIterator[etcd_store.EtcdStore]:
    async with etcd_server.store(timeout=3) as s:
        yield s


@pytest.fixture
def shard() -> tuple[str, str]:
    return "ns", f"shard-{next(_names)}"


async def test_first_publish_becomes_generation_one(store: etcd_store.EtcdStore, shard: tuple[str, str]) -> None:
    assert await store.read_current(*shard) is None
    await store.publish(*shard, placement(1), expected=0)
    assert await store.current_generation(*shard) == 1
    assert await store.read_current(*shard) == placement(1)
    assert etcd_keys.assignment_key(*shard, 1) in await store.keys(*shard)


async def test_publish_with_a_stale_expectation_is_refused(
    store: etcd_store.EtcdStore, shard: tuple[str, str]
) -> None:
    await store.publish(*shard, placement(1), expected=0)
    await store.publish(*shard, placement(2), expected=1)
    with pytest.raises(etcd_store.GenerationConflictError):
        await store.publish(*shard, placement(3), expected=1)
    assert await store.current_generation(*shard) == 2


async def test_large_generations_are_chunked_and_old_ones_pruned(
    store: etcd_store.EtcdStore, shard: tuple[str, str]
) -> None:
    for g in range(1, 5):
        await store.publish(*shard, placement(g, items=120_000), expected=g - 1)
    keys = await store.keys(*shard)
    generations = {k.split("/gen/")[1].split("/")[0] for k in keys if "/gen/" in k}
    assert generations == {"3", "4"}
    assert sum("/itemmap/" in k and "/chunks/" in k for k in keys) > 1  # schema 2: one content-addressed map
    assert (await store.read_current(*shard)) == placement(4, items=120_000)


async def test_a_late_writer_of_a_large_generation_never_touches_the_published_one(
    store: etcd_store.EtcdStore, shard: tuple[str, str]
) -> None:
    await store.publish(*shard, placement(1), expected=0)
    ours = placement(2, items=120_000)
    await store.publish(*shard, ours, expected=1)
    late = dataclasses.replace(ours, assignment={0: ("pod-b",), 1: ("pod-a",), 2: ("pod-b",)})
    with pytest.raises(etcd_store.GenerationConflictError):
        await store.publish(*shard, late, expected=1)  # computed from generation 1, like a second operator
    assert await store.read_current(*shard) == ours


async def test_two_writers_racing_with_large_generations_leave_one_whole_winner(
    etcd_server: EtcdServer, store: etcd_store.EtcdStore, shard: tuple[str, str]
) -> None:
    await store.publish(*shard, placement(1), expected=0)
    ours = placement(2, items=120_000)
    theirs = dataclasses.replace(ours, assignment={0: ("pod-b",), 1: ("pod-a",), 2: ("pod-b",)})
    async with etcd_server.store(timeout=10) as other:
        results = await asyncio.gather(store.publish(*shard, ours, expected=1),
                                       other.publish(*shard, theirs, expected=1), return_exceptions=True)
    conflicts = [r for r in results if isinstance(r, etcd_store.GenerationConflictError)]
    assert len(conflicts) == 1 and results.count(2) == 1, results
    winner = ours if results[0] == 2 else theirs
    assert await store.current_generation(*shard) == 2
    assert await store.read_current(*shard) == winner  # whole, never a mix of both writers' chunks
    assert not [k for k in await store.keys(*shard) if k.endswith("/writer")]


async def test_watch_yields_current_then_each_new_generation(
    store: etcd_store.EtcdStore, shard: tuple[str, str]
) -> None:
    await store.publish(*shard, placement(1), expected=0)
    seen: list[int] = []

    async def follow() -> None:
        async for p in store.watch_current(*shard):
            seen.append(p.generation)
            if p.generation == 3:
                return

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.3)
    await store.publish(*shard, placement(2), expected=1)
    await store.publish(*shard, dataclasses.replace(placement(3), pods=("pod-c",)), expected=2)
    await asyncio.wait_for(task, timeout=10)
    assert seen == [1, 2, 3]


async def test_a_slow_watcher_still_gets_every_generation_whole_after_it_was_pruned(
    store: etcd_store.EtcdStore, shard: tuple[str, str]
) -> None:
    await store.publish(*shard, placement(1), expected=0)
    watcher = store.watch_current(*shard)
    assert (await anext(watcher)).generation == 1
    for g in (2, 3, 4):  # publishing 4 prunes 2 before the watcher gets to it
        await store.publish(*shard, placement(g, items=20 + g), expected=g - 1)
    assert not [k for k in await store.keys(*shard) if "/gen/2/" in k]
    caught_up = [await asyncio.wait_for(anext(watcher), timeout=10) for _ in range(3)]
    assert caught_up == [placement(g, items=20 + g) for g in (2, 3, 4)]
    await watcher.aclose()


async def test_a_generation_read_at_a_compacted_revision_is_read_as_it_is_now(
    etcd_server: EtcdServer, store: etcd_store.EtcdStore, shard: tuple[str, str]
) -> None:
    import etcd3aio

    await store.publish(*shard, placement(1), expected=0)
    async with etcd3aio.Etcd3Client([etcd_server.endpoint], **etcd_server.client_args()) as admin:
        assert admin.kv is not None
        then = (await admin.kv.get("any")).header.revision
        await store.publish(*shard, placement(2), expected=1)
        await admin.kv.compact((await admin.kv.get("any")).header.revision)
    assert await store.read_generation(*shard, 1, revision=then) == placement(1)


async def test_heat_snapshots_expire_with_their_lease(store: etcd_store.EtcdStore, shard: tuple[str, str]) -> None:
    await store.put_heat(*shard, {"0": 12.5}, ttl_seconds=1)
    assert [snap for _, snap in await store.read_heat(*shard)] == [{"0": 12.5}]
    for _ in range(50):
        await asyncio.sleep(0.2)
        if not await store.read_heat(*shard):
            break
    assert await store.read_heat(*shard) == []


async def test_warm_sets_are_per_pod(store: etcd_store.EtcdStore, shard: tuple[str, str]) -> None:
    await store.put_warm(*shard, "pod-a", ps.WarmReport(1, (2, 0), "http://a"))
    await store.put_warm(*shard, "pod-b", ps.WarmReport(1, (1,)))
    await store.delete_warm(*shard, "pod-b")
    assert await store.read_warm(*shard) == {"pod-a": ps.WarmReport(1, (0, 2), "http://a")}


async def test_watch_warm_reports_each_change(store: etcd_store.EtcdStore, shard: tuple[str, str]) -> None:
    seen: list[dict[str, ps.WarmReport]] = []

    async def follow() -> None:
        async for warm in store.watch_warm(*shard):
            seen.append(warm)
            if len(seen) == 3:
                return

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.3)
    await store.put_warm(*shard, "pod-a", ps.WarmReport(1, (1,)))
    await asyncio.sleep(0.3)
    await store.delete_warm(*shard, "pod-a")
    await asyncio.wait_for(task, timeout=10)
    assert seen == [{}, {"pod-a": ps.WarmReport(1, (1,))}, {}]


async def test_delete_all_removes_every_key_of_one_shard_only(
    store: etcd_store.EtcdStore, shard: tuple[str, str]
) -> None:
    other = (shard[0], shard[1] + "-other")
    await store.publish(*shard, placement(1), expected=0)
    await store.publish(*other, placement(1), expected=0)
    assert await store.delete_all(*shard) > 0
    assert await store.keys(*shard) == []
    assert await store.current_generation(*other) == 1


async def test_etcd_down_is_a_typed_error_and_current_stays_complete(tmp_path: object) -> None:
    with EtcdServer() as server:
        async with server.store(timeout=1, attempts=1) as store:
            await store.publish("ns", "x", placement(1), expected=0)
            server.stop()
            with pytest.raises(etcd_store.EtcdUnavailableError):
                await store.publish("ns", "x", placement(2), expected=1)
            server.start()
            await etcd_store.wait_for(store, timeout=10)
            assert await store.read_current("ns", "x") == placement(1)


async def test_a_store_opened_after_an_outage_reads_at_once_while_another_store_was_failing() -> None:
    # gRPC shares connections per address across a process; a store that kept failing during the outage
    # must not hand its reconnect backoff to a store opened once etcd is back (the rebalancer opens one
    # per interval).
    with EtcdServer() as server:
        async with server.store(timeout=1, attempts=1) as long_lived:
            await long_lived.publish("ns", "outage", placement(1), expected=0)
            server.stop()
            for _ in range(20):
                with pytest.raises(etcd_store.EtcdUnavailableError):
                    await long_lived.read_current("ns", "outage")
                await asyncio.sleep(0.3)
            server.start()
            async with server.store(timeout=1, attempts=1) as fresh:
                assert await fresh.current_generation("ns", "outage") == 1
            await etcd_store.wait_for(long_lived, timeout=5)
            assert await long_lived.current_generation("ns", "outage") == 1


async def test_store_authenticates_with_username_and_password() -> None:
    import etcd3aio

    with EtcdServer() as server:
        async with etcd3aio.Etcd3Client([server.endpoint], **server.client_args()) as admin:
            assert admin.auth is not None
            await admin.auth.user_add("root", "rootpw")
            await admin.auth.user_grant_role("root", "root")
            await admin.auth.auth_enable()
        async with server.store(username="root", password="rootpw", timeout=3) as store:
            await store.publish("ns", "secured", placement(1), expected=0)
            assert await store.current_generation("ns", "secured") == 1
        async with server.store(timeout=3) as anonymous:
            with pytest.raises(etcd_store.EtcdAuthError):
                await anonymous.current_generation("ns", "secured")
        with pytest.raises(etcd_store.EtcdAuthError):
            async with server.store(username="root", password="wrong", timeout=3):
                pass


def test_each_etcd_server_has_its_own_port_and_data_that_survive_a_restart() -> None:
    with EtcdServer() as a, EtcdServer() as b:
        assert a.endpoint != b.endpoint and a.data_dir != b.data_dir

        async def write_then_read(server: EtcdServer, restart: bool) -> int:
            async with server.store(timeout=3) as s:
                await s.publish("ns", "kept", placement(1), expected=0)
            if restart:
                server.stop()
                assert not server.running
                server.start()
            async with server.store(timeout=3) as s:
                return await s.current_generation("ns", "kept")

        assert asyncio.run(write_then_read(a, restart=True)) == 1
        data_dir = a.data_dir
    assert not data_dir.exists()
