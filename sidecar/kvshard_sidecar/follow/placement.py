"""A sidecar follows its CacheShard's placement in etcd: warm what is assigned, drop what moved away.

Control path (docs/architecture.md#components, docs/architecture.md#placement-and-scheduling): the operator
publishes a placement generation; every sidecar watches
``current``, takes the clusters assigned to its pod name, queues their items' blocks on the
:class:`~kvshard_sidecar.serving.prefill_queue.PrefillQueue` (so warming takes turns with requests on the one
compute semaphore), and reports under ``warm/<pod>`` which clusters are complete. The router moves
traffic to a replica only once it reports the cluster warm, so a cluster counts as warm only when
*every* item block of it is stored locally — checked against the store, not assumed from the queue.
A cluster that moves away is evicted from memory and disk at once and dropped from the report.

Each generation names the catalog version and the prompt template it was placed for; before
applying a generation whose version or template differs from the one in use, the follower loads
that version from etcd and switches the service to it (:meth:`SidecarService.use_catalog`). Then a
cluster whose items changed (added, removed, or a new text, hence a new block key) is warmed again —
only its new blocks cost a prefill — and the blocks of removed or edited items are evicted.

etcd is not on the request path: when it is unreachable the sidecar keeps serving what it stores,
warming goes on, and the follower retries with a capped backoff; each new session re-reads
``current`` and re-sends the latest warm report, so nothing published meanwhile is missed. Every
session also watches the warm reports, which feed :class:`~kvshard_sidecar.blockstore.peers.PlacementHolders`
(who to ask for a block on a local miss).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvshard.etcd_store import EtcdStore, EtcdStoreError, EtcdUnavailableError
from kvshard.etcd_tls import EtcdTLSConfigError
from kvshard.placement_schema import Placement, PlacementFormatError, WarmReport
from kvshard.tasks import cancel_and_wait
from kvshard_sidecar.follow.blend import follow_blend
from kvshard_sidecar.serving.prefill_queue import WarmUnit
from kvshard_sidecar.serving.service import SidecarService

log = logging.getLogger(__name__)

WARM_BATCH = 8
"""Items prefilled in one pass: batching amortises the per-pass cost (8 items cost ~1.5x one item),
and a request waits for at most one unit (well under a second on an idle CPU)."""
REPORT_INTERVAL_S = 0.5
"""Debounce: at most ~2 warm reports a second, always the latest state."""
BACKOFF_FIRST_S = 0.2
BACKOFF_CAP_S = 5.0
STOP_TIMEOUT_S = 2.0


class _Assignment:
    """One assigned cluster: its items and its units still queued. Identity matters: a unit belongs
    to the assignment object it was queued for, so one queued before a drop-and-reassign is stale."""

    def __init__(self, items: tuple[str, ...], units: int, keys: tuple[str, ...] = ()) -> None:
        self.items = items
        self.outstanding = units
        self.keys = keys
        """The items' block keys when assigned: a changed key (new text or template) re-warms the cluster."""


class PlacementFollower:
    """Follows one CacheShard's placement for one pod (``settings.name``) on the app's event loop."""

    def __init__(self, service: SidecarService, history_users: Sequence[str] = ()) -> None:
        settings = service.settings
        self._history_users = list(history_users)
        self.service = service
        self.pod = settings.name
        self.url = settings.url
        self.namespace, self.shard = settings.shard
        self.generation = 0
        self.warm: set[int] = set()
        self._assigned: dict[int, _Assignment] = {}
        self._dirty = asyncio.Event()
        self._etcd_down = False
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ state

    @property
    def assigned(self) -> list[int]:
        return sorted(self._assigned)

    def report(self) -> WarmReport:
        warm = tuple(sorted(self.warm))
        return WarmReport(self.generation, warm, self.url, warming=len(self._assigned) - len(warm))

    def state(self) -> dict[str, Any]:
        """What ``GET /v1/warm`` shows."""
        report = self.report()
        return {"pod": self.pod, "cacheshard": f"{self.namespace}/{self.shard}", "url": self.url,
                "generation": self.generation, "assigned": self.assigned, "warm": list(report.clusters),
                "warming": report.warming, "etcd": "unavailable" if self._etcd_down else "ok",
                "pending_blocks": self.service.prefill_queue.pending_blocks}

    def _changed(self) -> None:
        metrics, name = self.service.metrics, self.service.model_name
        metrics.assigned_clusters.labels(name).set(len(self._assigned))
        metrics.warm_clusters.labels(name).set(len(self.warm))
        metrics.placement_generation.labels(name).set(self.generation)
        self._dirty.set()

    def _keys(self, items: Mapping[int, _Assignment] | None = None) -> set[str]:
        """Block keys of every item of the (given, else assigned) clusters."""
        return {key for a in (self._assigned if items is None else items).values() for key in a.keys}

    # ------------------------------------------------------------------ placement → warming

    async def apply(self, placement: Placement, store: EtcdStore | None = None) -> None:
        """Take one placement generation: switch to its catalog version and template (read from
        ``store``) when they differ from the ones in use, warm newly assigned or changed clusters,
        evict the blocks no longer wanted here."""
        before = self._keys()
        service = self.service
        if store is not None and placement.catalog and (
                placement.catalog != service.catalog_version or dict(placement.prompt) != dict(service.prompt_spec)):
            catalog_data = await store.read_catalog(self.namespace, self.shard, placement.catalog)
            await service.prefill_queue.exclusive(service.use_catalog, catalog_data, placement.catalog,
                                                  placement.prompt)
        catalog = self.service.item_block_keys
        by_cluster: dict[int, list[str]] = {}
        unknown = 0
        for item, cluster in placement.item_clusters.items():
            if item in catalog:
                by_cluster.setdefault(cluster, []).append(item)
            else:
                unknown += 1
        if unknown:
            log.warning("placement generation %d names %d items this sidecar's catalog does not have; "
                        "they are not warmed", placement.generation, unknown)
        wanted = {c: tuple(sorted(by_cluster.get(c, ()), key=_item_order)) for c in placement.clusters_of(self.pod)}
        dropped = [c for c in self._assigned if c not in wanted]
        for cluster in dropped:
            del self._assigned[cluster]
            self.warm.discard(cluster)
        started = [c for c, items in wanted.items() if c not in self._assigned or self._assigned[c].items != items
                   or self._assigned[c].keys != tuple(catalog[i] for i in items)]
        for cluster in started:
            self._start(cluster, wanted[cluster])
        self._warm_history()
        self.generation = placement.generation
        if self.service.holders is not None:
            self.service.holders.update_placement(placement)
        log.info("placement generation %d: pod %s holds clusters %s (warming %s, dropped %s)",
                 placement.generation, self.pod, self.assigned, started, dropped)
        self._changed()
        await self._evict(before - self._keys())
        for cluster in started:  # clusters with nothing to compute are complete at once
            if self._assigned[cluster].outstanding == 0:
                self._check_complete(cluster)

    def _start(self, cluster: int, items: tuple[str, ...]) -> None:
        keys = self.service.item_block_keys
        todo = tuple(i for i in items if self.service.store.contains(keys[i]) is None)  # only what is missing
        chunks = [todo[i:i + WARM_BATCH] for i in range(0, len(todo), WARM_BATCH)]
        assignment = _Assignment(items, len(chunks), tuple(keys[i] for i in items))
        self._assigned[cluster] = assignment
        self.warm.discard(cluster)

        def wanted() -> bool:
            return self._assigned.get(cluster) is assignment

        async def done(unit: WarmUnit) -> None:
            if self._assigned.get(cluster) is not assignment:
                # moved away while this unit computed: its blocks were stored after the eviction
                keys = self.service.item_block_keys
                await self._evict({keys[i] for i in unit.idents if i in keys} - self._keys())
                return
            assignment.outstanding -= 1
            if assignment.outstanding == 0:
                self._check_complete(cluster)

        self.service.prefill_queue.submit_units(WarmUnit("item", chunk, wanted, done) for chunk in chunks)

    def _warm_history(self) -> None:
        """Queue the histories warmed ahead (once), behind the clusters: the router waits for those."""
        if self._history_users:
            units = (WarmUnit("user", (user,)) for user in self._history_users)
            self.service.prefill_queue.submit_units(units, priority=1)
            self._history_users = []

    def _check_complete(self, cluster: int) -> None:
        assignment = self._assigned[cluster]
        keys = list(assignment.keys)
        if self.service.stored(keys):
            self.warm.add(cluster)
            log.info("cluster %d is warm (%d item blocks)", cluster, len(keys))
            self._changed()
        else:
            missing = sum(self.service.store.contains(k) is None for k in keys)
            log.warning("cluster %d: %d of %d item blocks are not stored after warming (budgets too small, "
                        "or prefill failed: see above); it stays 'warming'", cluster, missing, len(keys))

    async def _evict(self, keys: set[str]) -> None:
        if not keys:
            return
        evicted = await asyncio.get_running_loop().run_in_executor(None, self.service.evict_blocks, keys)
        self.service.metrics.evicted_blocks.labels(self.service.model_name).inc(evicted)
        log.info("evicted %d item blocks of clusters moved off this pod", evicted)

    # ------------------------------------------------------------------ etcd sessions

    def start(self) -> None:
        self._changed()
        self._task = asyncio.get_running_loop().create_task(self.run(), name="placement-follower")

    async def stop(self) -> None:
        """Cancel the follower and withdraw this pod's warm report (best effort: etcd may be down)."""
        if self._task is None:
            return
        await cancel_and_wait(self._task)
        try:
            store = self._store()
        except EtcdTLSConfigError as error:
            log.warning("could not withdraw the warm report of %s: %s", self.pod, error)
            return
        try:
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await store.connect()
                await store.delete_warm(self.namespace, self.shard, self.pod)
        except (EtcdStoreError, TimeoutError) as error:
            log.warning("could not withdraw the warm report of %s: %s", self.pod, error)
        finally:
            await store.close()

    def _store(self) -> EtcdStore:
        s = self.service.settings
        return EtcdStore(s.etcd_endpoints, username=s.etcd_username or None, password=s.etcd_password or None,
                         tls=s.etcd_tls(), timeout=3.0)

    async def run(self) -> None:
        """One session per connection: watch placement, watch warm reports, report; on any etcd
        failure tear the session down, back off (capped), and start a fresh one."""
        backoff = BACKOFF_FIRST_S
        while True:
            try:
                store = self._store()
            except EtcdTLSConfigError as error:  # a TLS file went away or was replaced by garbage
                log.error("following %s/%s: %s; retrying", self.namespace, self.shard, error)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_CAP_S)
                continue
            try:
                await store.connect()
                self._dirty.set()  # (re-)send the latest report in every session
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._follow_placement(store))
                    group.create_task(self._follow_warm(store))
                    group.create_task(self._report(store))
                    group.create_task(follow_blend(store, self.namespace, self.shard, self.service))
            except* EtcdUnavailableError as errors:
                self._warm_history()  # no placement to wait for
                if not self._etcd_down:
                    log.warning("etcd unreachable (%s); serving what is stored, retrying", errors.exceptions[0])
                self._etcd_down = True
            except* (EtcdStoreError, PlacementFormatError) as errors:
                log.error("following %s/%s failed: %s; retrying", self.namespace, self.shard, errors.exceptions[0])
            except* Exception as errors:  # a bug must not end following for good: log it whole, retry
                log.error("following %s/%s failed; retrying", self.namespace, self.shard,
                          exc_info=errors.exceptions[0])
            finally:
                await store.close()
            if not self._etcd_down:
                backoff = BACKOFF_FIRST_S
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_CAP_S)

    def _reachable(self) -> None:
        if self._etcd_down:
            log.info("etcd reachable again; following %s/%s", self.namespace, self.shard)
            self._etcd_down = False

    async def _follow_placement(self, store: EtcdStore) -> None:
        # Yields ``current`` first, so a new session re-reads it; applying a generation again is a no-op.
        async for placement in store.watch_current(self.namespace, self.shard):
            self._reachable()
            await self.apply(placement, store)

    async def _follow_warm(self, store: EtcdStore) -> None:
        async for reports in store.watch_warm(self.namespace, self.shard):
            if self.service.holders is not None:
                self.service.holders.update_warm(reports)

    async def _report(self, store: EtcdStore) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await store.put_warm(self.namespace, self.shard, self.pod, self.report())
            except BaseException:
                self._dirty.set()  # still owed: the next session sends it
                raise
            self._reachable()
            await asyncio.sleep(REPORT_INTERVAL_S)


def _item_order(item: str) -> tuple[int, str]:
    """Numeric ids in number order (MovieLens), others after them by text."""
    return (int(item), "") if item.isdigit() else (1 << 62, item)
