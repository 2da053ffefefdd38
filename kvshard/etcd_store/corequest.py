"""The co-request key space: ``corequest/<router>``, each router's last interval of co-requested pairs.

Why its own module: like heat snapshots the reports live under a lease (a router that died stops
counting once its lease runs out), but they are one key per router, written by routers and read by
the operator's rebalancer (:mod:`kvshard.corequest_schema` holds their format).
"""

from __future__ import annotations

import logging

from kvshard import corequest_schema as crs
from kvshard.etcd_keys import corequest_key, corequest_prefix
from kvshard.etcd_store.client import EtcdClient

log = logging.getLogger("kvshard.etcd_store")  # every key space logs under the store's one name


class CoRequestStore(EtcdClient):
    """Each router's co-request report."""

    async def put_corequest(self, namespace: str, name: str, report: crs.CoRequestReport, *,
                            ttl_seconds: int) -> None:
        """A router publishes its interval's top pairs; etcd deletes them after ``ttl_seconds`` unless
        the router publishes again (a new lease each interval, as for heat snapshots)."""
        data = report.encode()
        lease_svc = self._client.lease
        assert lease_svc is not None
        lease = await self._call("lease", lease_svc.grant(ttl_seconds, timeout=self.timeout))
        await self._call("put", self._kv.put(corequest_key(namespace, name, report.router), data,
                                             lease=lease.ID, timeout=self.timeout))

    async def read_corequest(self, namespace: str, name: str) -> dict[str, crs.CoRequestReport]:
        """Router → its live report. Unreadable reports are skipped (one bad writer fails no reader)."""
        prefix = corequest_prefix(namespace, name)
        out: dict[str, crs.CoRequestReport] = {}
        for kv in (await self._range("read", prefix)).kvs:
            try:
                out[kv.key.decode()[len(prefix):]] = crs.CoRequestReport.decode(kv.value)
            except crs.CoRequestFormatError as exc:
                log.warning("skipping %s: %s", kv.key.decode(), exc)
        return out
