"""Issue 13 measurement: a 1 M-item catalog version distributed to 3 pods through etcd.

Publishes a synthetic catalog (``kvshard bench catalog``'s items) on a real TLS etcd, then reads and hash-checks
it three times with the follower's own call (``EtcdStore.read_catalog``), reporting the bytes in etcd, the time
per pod and the memory a pod needs for it. Run: ``.venv/bin/python bench/experiments/catalog_million_load.py``
(about 1 minute). Not included: the sidecar's block keys for every item, computed when it switches versions.
"""

from __future__ import annotations

import asyncio
import resource
import sys
import time
import tracemalloc

from kvshard_bench.catalog import synthetic
from kvshard_local.testing_servers import EtcdServer

ITEMS = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000


async def measure(server: EtcdServer) -> None:
    catalog = synthetic(ITEMS, 0)
    async with server.store(timeout=60) as store:
        started = time.perf_counter()
        written = await store.put_catalog("bench", "big", catalog)
        print(f"published: {written / 2**20:.1f} MiB in etcd in {time.perf_counter() - started:.1f} s", flush=True)
    for pod in range(3):
        async with server.store(timeout=60) as store:
            tracemalloc.start()
            started = time.perf_counter()
            loaded = await store.read_catalog("bench", "big", catalog.version)
            seconds = time.perf_counter() - started
            held, peak = (value / 2**20 for value in tracemalloc.get_traced_memory())
            tracemalloc.stop()
            assert loaded.version == catalog.version and len(loaded) == ITEMS
            print(f"pod {pod}: read and hash-checked {len(loaded)} items in {seconds:.2f} s; "
                  f"peak {peak:.0f} MiB during the load, {held:.0f} MiB held after", flush=True)


if __name__ == "__main__":
    with EtcdServer() as etcd:
        asyncio.run(measure(etcd))
    print(f"process max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
