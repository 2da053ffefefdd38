"""Issue 41 item 2: one etcd connection per distinct access, per operator process, not one per tick;
the etcd Secret read from the operator's Secret index, not from the API on every tick.

The operator runs under KopfRunner against the local Kubernetes API and a real TLS etcd with three
idle CacheShards for ``KVSHARD_TEST_IDLE_SECONDS`` (30 s by default) while the pod, warm, catalog and
fidelity timers tick. Every ``EtcdClient.connect`` made off the test's own thread (the operator's)
is counted; before the shared holder (:mod:`kvshard_operator.etcd_clients`) this was one per tick
and per CacheShard (dozens over the run), now it is one.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest
from emulated import EmulatedCluster, condition, read_current
from polling import wait_until
from test_operator_e2e import LABELS, operator, shard

from kvshard import placement_schema as ps
from kvshard.etcd_store import client as etcd_client
from kvshard_local.testing_servers import EtcdServer
from kvshard_operator import etcd_clients, kube, metrics

pytestmark = pytest.mark.slow
IDLE_SECONDS = float(os.environ.get("KVSHARD_TEST_IDLE_SECONDS", "30"))


def test_idle_shards_share_one_etcd_connection(cluster: EmulatedCluster, etcd: EtcdServer, catalog_file: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    main = threading.main_thread()
    opened: list[float] = []
    connect = etcd_client.EtcdClient.connect

    async def counted(self: etcd_client.EtcdClient) -> None:
        if not self._connected and threading.current_thread() is not main:
            opened.append(time.monotonic())
        await connect(self)

    monkeypatch.setattr(etcd_client.EtcdClient, "connect", counted)
    api_reads: list[str] = []
    read_secret = kube.read_secret

    def counted_read(namespace: str, name: str) -> dict[str, bytes]:
        api_reads.append(f"{namespace}/{name}")
        return read_secret(namespace, name)

    monkeypatch.setattr(kube, "read_secret", counted_read)
    holder = etcd_clients.CLIENTS  # the process's holder: earlier operator runs in this process counted too
    before = holder.opened
    cluster.trust_etcd(etcd)
    for i in range(2):
        cluster.create_pod(f"engine-{i}", LABELS)
    names = ["one", "two", "three"]
    with operator():
        for name in names:
            cluster.create_shard(shard(name, etcd, catalog_file, clusters=4))
        for name in names:
            wait_until(lambda n=name: condition(cluster.shard(n), "Ready").get("status") == "True",
                       what=f"{name} Ready")
        started, at_start, reads_at_start = time.monotonic(), len(opened), len(api_reads)
        time.sleep(IDLE_SECONDS)
        during, reads_during = len(opened) - at_start, len(api_reads) - reads_at_start
        idle = time.monotonic() - started

        # the Warm condition follows a warm report through the daemon's watch, not a poll of etcd
        current = read_current(etcd, "one")
        reported = time.monotonic()
        for pod in current.pods:
            report = ps.WarmReport(current.generation, current.clusters_of(pod), f"http://{pod}:8100", 0)
            asyncio.run(_put_warm(etcd, "one", pod, report))
        wait_until(lambda: condition(cluster.shard("one"), "Warm").get("status") == "True", what="one Warm",
                   every=0.05)
        warm_after = time.monotonic() - reported
        written = metrics.PLACEMENT_BYTES_WRITTEN.labels("default/one")._value.get()
        db_size = wait_until(lambda: metrics.ETCD_DB_BYTES.labels("default/one")._value.get(), what="etcd DB size")
    # outside the runner, which captures stdout while it runs
    print(f"\netcd connections opened by the operator: {len(opened)} in all, {during} during {idle:.0f} s idle "
          f"with {len(names)} CacheShards; holder opened {holder.opened - before}; Secret reads from the API: "
          f"{len(api_reads)} in all, {reads_during} while idle; Warm=True {warm_after:.2f} s after the reports; "
          f"generation 1 wrote {written:.0f} B, etcd DB {db_size:.0f} B")
    assert len(opened) <= 3, f"{len(opened)} etcd connections opened (one per distinct access expected)"
    assert holder.opened - before <= 3
    assert len(holder) == 0  # closed at operator cleanup
    assert reads_during == 0, api_reads  # the etcd Secret comes from the operator's index, not once per tick
    # generation 1 wrote its catalog (40 items), item map and assignment; etcd's DB is at least that big
    assert 40 * 10 < written < db_size, (written, db_size)
    assert warm_after < 2.5  # the watch plus one 0.5 s timer tick and the status patch (a 2 s poll before)


async def _put_warm(etcd: EtcdServer, name: str, pod: str, report: ps.WarmReport) -> None:
    async with etcd.store(timeout=2, attempts=1) as store:
        await store.put_warm("default", name, pod, report)
