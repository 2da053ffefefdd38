"""The reports key spaces: ``heat/<timestamp>`` snapshots and each pod's ``warm/<pod>`` report.

Why its own module: these keys are written by many (every sidecar reports its warm set, the operator
its heat snapshots under a lease, so etcd expires them) and read as a whole map, never one key at a
time. Readers skip an unreadable report instead of failing: one pod writing garbage must not stop the
router or the operator. :meth:`WarmStore.watch_warm` keeps the map from the watch's events rather than
re-reading it, since every pod reports up to twice a second and every router and sidecar watches.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import etcd3aio

from kvshard import placement_schema as ps
from kvshard.etcd_keys import heat_prefix, warm_key, warm_prefix
from kvshard.etcd_store.client import ETCD_ERRORS, EtcdClient, EtcdUnavailableError


class WarmStore(EtcdClient):
    """Heat snapshots and warm reports."""

    async def put_heat(
        self, namespace: str, name: str, snapshot: Mapping[str, Any], *, ttl_seconds: int,
        timestamp: float | None = None,
    ) -> str:
        """Store a hit-rate snapshot that etcd deletes by itself after ``ttl_seconds``."""
        lease_svc = self._client.lease
        assert lease_svc is not None
        lease = await self._call("lease", lease_svc.grant(ttl_seconds, timeout=self.timeout))
        ms = int((time.time() if timestamp is None else timestamp) * 1000)
        key = heat_prefix(namespace, name) + f"{ms:015d}"
        await self._call("put", self._kv.put(key, json.dumps(dict(snapshot)), lease=lease.ID, timeout=self.timeout))
        return key

    async def read_heat(self, namespace: str, name: str) -> list[tuple[float, dict[str, Any]]]:
        """Live heat snapshots, oldest first, as ``(unix seconds, snapshot)``."""
        prefix = heat_prefix(namespace, name)
        resp = await self._range("read", prefix)
        out = [(int(kv.key.decode()[len(prefix):]) / 1000, json.loads(kv.value)) for kv in resp.kvs]
        return sorted(out, key=lambda pair: pair[0])

    async def put_warm(self, namespace: str, name: str, pod: str, report: ps.WarmReport) -> None:
        """A sidecar reports the clusters it has warmed and where it answers."""
        await self._call("put", self._kv.put(warm_key(namespace, name, pod), report.encode(), timeout=self.timeout))

    async def read_warm(self, namespace: str, name: str) -> dict[str, ps.WarmReport]:
        """Pod → its last warm report; the router moves traffic only to warm replicas. Unreadable
        reports are skipped (a reader never fails because one pod wrote garbage)."""
        prefix = warm_prefix(namespace, name)
        return _warm_reports(prefix, (await self._range("read", prefix)).kvs)

    async def watch_warm(self, namespace: str, name: str) -> AsyncIterator[dict[str, ps.WarmReport]]:
        """Yield the whole warm map now and again after every change (a pod reported or left);
        the router moves traffic to a new replica only once it shows up here. The map is read once
        and then kept up to date from the watch's events (every pod reports up to twice a second,
        and every router and sidecar watches)."""
        prefix = warm_prefix(namespace, name)
        resp = await self._range("read", prefix)
        reports = _warm_reports(prefix, resp.kvs)
        yield dict(reports)
        watch = self._client.watch
        assert watch is not None
        try:
            async for batch in watch.watch(prefix, range_end=etcd3aio.prefix_range_end(prefix),
                                           start_revision=resp.header.revision + 1):
                for event in batch.events:
                    pod = event.kv.key.decode()[len(prefix):]
                    report = _warm_report(event.kv.value) if event.type == 0 else None  # 0 == PUT
                    if report is None:
                        reports.pop(pod, None)  # withdrawn, or unreadable
                    else:
                        reports[pod] = report
                if batch.events:
                    yield dict(reports)
        except ETCD_ERRORS as exc:
            raise EtcdUnavailableError(f"etcd watch failed: {exc}") from exc

    async def delete_warm(self, namespace: str, name: str, pod: str) -> None:
        """Forget a pod's warm set (it left the placement)."""
        await self._call("delete", self._kv.delete(warm_key(namespace, name, pod), timeout=self.timeout))

def _warm_report(value: bytes) -> ps.WarmReport | None:
    try:
        return ps.WarmReport.decode(bytes(value))
    except ps.PlacementFormatError:
        return None


def _warm_reports(prefix: str, kvs: Any) -> dict[str, ps.WarmReport]:
    """Pod → report of the ``warm/`` keys read, the unreadable ones skipped."""
    return {kv.key.decode()[len(prefix):]: report for kv in kvs if (report := _warm_report(kv.value)) is not None}
