"""Publish the router's co-request sketch to etcd once per interval (the I/O edge of
:mod:`kvshard_router.corequest`).

Each interval's report goes under ``corequest/<router>`` with a lease of ``ttl_intervals`` intervals:
the operator reads whatever routers are alive, and a router that died drops out by itself instead of
its last interval being counted forever. A failed publish is logged and the interval's counts are
dropped (the next interval starts fresh): colocation is an optimisation, never worth blocking on.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvshard.etcd_store import EtcdStore, EtcdStoreError
from kvshard_router.corequest import CoRequestSketch

log = logging.getLogger(__name__)


class CoRequestPublisher:
    def __init__(self, store: EtcdStore, namespace: str, name: str, router: str, sketch: CoRequestSketch, *,
                 interval_seconds: float, top: int = 1024, ttl_intervals: int = 3) -> None:
        if interval_seconds <= 0 or top < 1 or ttl_intervals < 1:
            raise ValueError("interval_seconds, top and ttl_intervals must be positive")
        self.store, self.namespace, self.name, self.router = store, namespace, name, router
        self.sketch, self.interval, self.top, self.ttl_intervals = sketch, interval_seconds, top, ttl_intervals

    async def publish_once(self) -> bool:
        """Publish the interval so far (if any request was counted); True when a report was written."""
        if not self.sketch.requests:
            return False
        report = self.sketch.take(self.router, self.top, time.time())
        try:
            await self.store.put_corequest(self.namespace, self.name, report,
                                           ttl_seconds=max(1, round(self.ttl_intervals * self.interval)))
        except EtcdStoreError as exc:
            log.warning("co-request sketch not published this interval: %s", exc)
            return False
        return True

    async def run(self) -> None:
        """Publish every ``interval_seconds`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            await self.publish_once()
