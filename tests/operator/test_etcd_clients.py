"""The per-process etcd store holder (:mod:`kvshard_operator.etcd_clients`) against a real etcd:
one store per access, shared; dropped after an outage and reopened after a capped backoff; closed
at cleanup."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvshard import etcd_store
from kvshard_local.testing_servers import EtcdServer
from kvshard_operator import metrics
from kvshard_operator.etcd_clients import EtcdClients, session
from kvshard_operator.reconcile import EtcdAccess

pytestmark = pytest.mark.slow


def _access(etcd: EtcdServer) -> EtcdAccess:
    return EtcdAccess((etcd.endpoint,), tls=etcd.client_tls)


def test_one_store_per_access_is_shared_and_closed(etcd: EtcdServer) -> None:
    async def run() -> None:
        clients = EtcdClients()
        before = metrics.ETCD_CONNECTIONS_OPENED._value.get()
        access = _access(etcd)
        stores = []
        for _ in range(5):
            async with clients.use(access, timeout=2) as store:
                await store.current_generation("ns", "a")
                stores.append(store)
        async def concurrent() -> etcd_store.EtcdStore:
            async with clients.use(EtcdAccess((etcd.endpoint,), tls=etcd.client_tls), timeout=2) as store:
                await store.read_warm("ns", "a")
                return store
        stores += await asyncio.gather(*(concurrent() for _ in range(10)))
        assert len({id(s) for s in stores}) == 1 and clients.opened == 1 and len(clients) == 1
        assert metrics.ETCD_CONNECTIONS_OPENED._value.get() - before == 1
        async with clients.use(access, timeout=3) as other:  # another per-call timeout: another store
            assert other is not stores[0] and other.timeout == 3
        await clients.close()
        assert len(clients) == 0

    asyncio.run(run())


def test_an_outage_drops_the_store_and_it_reopens_after_backoff(etcd: EtcdServer) -> None:
    async def run() -> None:
        clients = EtcdClients(backoff_seconds=0.5, backoff_max=1.0)
        access = _access(etcd)
        async with clients.use(access, timeout=1) as store:
            await store.put_warm("ns", "a", "p", _report())
        etcd.stop()
        with pytest.raises(etcd_store.EtcdUnavailableError):
            async with clients.use(access, timeout=1) as store:
                await store.read_warm("ns", "a")
        assert len(clients) == 0  # dropped
        with pytest.raises(etcd_store.EtcdUnavailableError, match="reconnecting in"):
            async with clients.use(access, timeout=1):  # within the backoff: refused without a connect
                pass
        assert clients.opened == 1
        etcd.start()
        deadline = time.monotonic() + 15
        while True:
            try:
                async with clients.use(access, timeout=1) as store:
                    assert set(await store.read_warm("ns", "a")) == {"p"}
                break
            except etcd_store.EtcdUnavailableError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.3)
        assert clients.opened >= 2
        await clients.close()

    asyncio.run(run())


def test_without_a_holder_a_session_opens_and_closes_its_own_store(etcd: EtcdServer) -> None:
    async def run() -> None:
        async with session(_access(etcd), timeout=2) as store:
            assert await store.current_generation("ns", "a") == 0
        assert not store._connected

    asyncio.run(run())


def _report() -> object:
    from kvshard import placement_schema as ps

    return ps.WarmReport(1, (0,), "http://p:8100", 0)


def test_a_dropped_store_stays_open_until_its_last_caller_is_done(etcd: EtcdServer) -> None:
    """One handler's outage must not cancel another's call in flight on the shared channel: gRPC cancels
    a closed channel's calls, and kopf stops a timer whose handler was cancelled for good (seen: the
    pod-following timer ended at an etcd outage and the shard never turned Degraded)."""
    async def run() -> None:
        clients = EtcdClients(backoff_seconds=0.1, backoff_max=0.1)
        access = _access(etcd)
        inside, release = asyncio.Event(), asyncio.Event()

        async def long_caller() -> bool:
            async with clients.use(access, timeout=2) as store:
                inside.set()
                await release.wait()
                return store._connected

        holder = asyncio.create_task(long_caller())
        await inside.wait()
        with pytest.raises(etcd_store.EtcdUnavailableError):
            async with clients.use(access, timeout=2) as store:
                raise etcd_store.EtcdUnavailableError("an outage seen by another handler")
        assert len(clients) == 0  # no longer handed out
        await asyncio.sleep(0.2)
        release.set()
        assert await holder, "the dropped store was closed under a caller still using it"
        await asyncio.sleep(0.2)
        assert not store._connected  # closed once its last caller left
        await clients.close()

    asyncio.run(run())
