"""The store's traffic counters (``bytes_written``, ``bytes_read``) and ``db_size`` against a real etcd."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import pytest

from kvshard import etcd_store
from kvshard import placement_schema as ps
from kvshard_local.testing_servers import EtcdServer

pytestmark = pytest.mark.slow
_names = itertools.count()


@pytest.fixture
async def store(etcd_server: EtcdServer) -> AsyncIterator[etcd_store.EtcdStore]:
    async with etcd_server.store(timeout=3) as s:
        yield s


async def test_puts_and_reads_are_counted_key_plus_value(store: etcd_store.EtcdStore) -> None:
    assert (store.bytes_written, store.bytes_read) == (0, 0)
    await store._call("put", store._kv.put("/kvshard/t/a", b"x" * 100, timeout=3))
    assert store.bytes_written == len("/kvshard/t/a") + 100
    kv = store._kv
    await store._call("txn", kv.txn([], [kv.txn_op_put("/kvshard/t/b", b"y" * 10)], timeout=3))
    assert store.bytes_written == len("/kvshard/t/a") + 100 + len("/kvshard/t/b") + 10
    await store._range("read", "/kvshard/t/")
    assert store.bytes_read == len("/kvshard/t/a") + 100 + len("/kvshard/t/b") + 10


async def test_a_publish_and_a_read_are_counted(store: etcd_store.EtcdStore, etcd_server: EtcdServer) -> None:
    shard = ("ns", f"traffic-{next(_names)}")
    placement = ps.Placement(generation=1, assignment={0: ("p",)}, item_clusters={f"i{n}": 0 for n in range(50_000)},
                             pods=("p",))
    before = store.bytes_written
    await store.publish(*shard, placement, expected=0)
    written = store.bytes_written - before
    assert written > 50_000 * 8  # every item id went over the wire once at least
    # Another store: the publisher holds the map it published and reads no chunk of it back.
    async with etcd_server.store(timeout=3) as reader:
        assert await reader.read_current(*shard) == placement
        assert reader.bytes_read > 50_000 * 8
    before_read = store.bytes_read
    assert await store.read_current(*shard) == placement
    assert store.bytes_read - before_read < 16 * 1024


async def test_db_size_is_etcd_backend_size(store: etcd_store.EtcdStore) -> None:
    size = await store.db_size()
    assert size > 0
    await store._call("put", store._kv.put("/kvshard/t/big", b"z" * 900_000, timeout=3))
    assert await store.db_size() >= size
