"""Whether a CacheShard is serving from cache: the ``Warm`` condition and its status counts.

``Ready`` says the current spec is placed and published to etcd — the routers and sidecars follow
it from then on — but a just-published generation is cold: its pods still have to prefill the item
blocks of their clusters. Each sidecar reports what it has warmed under ``warm/<pod>`` in etcd
(:class:`kvshard.placement_schema.WarmReport`); the router sends a request to a replica only once
that replica is warm. So, for the current generation:

* a cluster is warm when at least one pod holding it reports it warm (``status.warmClusters``):
  its requests are served from cache;
* a pod is warm when it reports every cluster assigned to it (``status.warmPods``);
* ``Warm`` is ``True`` (``ClustersWarm``) when every cluster is warm, ``False`` while some are
  still warming (``Warming``) or nothing is placed yet (``NotPlaced``), and ``Unknown`` when etcd
  cannot be read (``EtcdUnavailable``).

The warm reports are *watched*, not polled: a per-CacheShard daemon keeps :func:`follow` running
on the process's shared etcd connection, which re-decides the warmth on every change of the reports
(and re-reads the assignment only when the generation moved) into a :class:`WarmWatch` in the
shard's memo. A short timer writes that decision to status: the handler applies :func:`apply` as a
kopf patch *function*, which kopf turns into a JSON patch of exactly these fields against the
freshest object, guarded by its resourceVersion, so it never overwrites conditions a concurrent
reconcile just wrote. So ``Warm`` follows a report within about a timer tick, without reading etcd
per tick.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping
from typing import Any

from kvshard import etcd_store
from kvshard import placement_schema as ps
from kvshard_operator import conditions as cond
from kvshard_operator import etcd_clients
from kvshard_operator.reconcile import SecretReader, etcd_access
from kvshard_operator.settings import Settings

WARMING, NOT_PLACED, ETCD_UNAVAILABLE, CLUSTERS_WARM = "Warming", "NotPlaced", "EtcdUnavailable", "ClustersWarm"


@dataclasses.dataclass(frozen=True)
class Warmth:
    """What the Warm condition and the status counts say, decided from etcd."""

    status: str
    reason: str
    message: str
    warm_pods: int | None = None
    warm_clusters: int | None = None

    def fields(self) -> dict[str, Any]:
        """The status counts to write (none when unknown)."""
        out: dict[str, Any] = {}
        if self.warm_pods is not None:
            out["warmPods"] = self.warm_pods
        if self.warm_clusters is not None:
            out["warmClusters"] = self.warm_clusters
        return out


def summarize(placement: ps.Placement | None, reports: Mapping[str, ps.WarmReport]) -> Warmth:
    """The warmth of ``placement`` given every pod's last report (reports of other generations
    do not count: they describe clusters the pod held before)."""
    if placement is None:
        return Warmth(cond.FALSE, NOT_PLACED, "no placement published to etcd yet", 0, 0)
    warm: dict[str, set[int]] = {}
    for pod, report in reports.items():
        if report.generation == placement.generation:
            warm[pod] = set(report.clusters)
    served = sum(1 for c, holders in placement.assignment.items() if any(c in warm.get(p, ()) for p in holders))
    pods = sorted(set(placement.pods) | {p for holders in placement.assignment.values() for p in holders})
    counts = {p: (len(set(placement.clusters_of(p)) & warm.get(p, set())), len(placement.clusters_of(p)))
              for p in pods}
    warm_pods = sum(1 for have, want in counts.values() if have == want)
    total = len(placement.assignment)
    detail = ", ".join(f"{p} {have}/{want}" for p, (have, want) in counts.items())
    message = (f"generation {placement.generation}: {served}/{total} clusters warm on at least one pod; "
               f"clusters warm per pod: {detail}")
    if served == total:
        return Warmth(cond.TRUE, CLUSTERS_WARM, message, warm_pods, served)
    return Warmth(cond.FALSE, WARMING, message, warm_pods, served)


async def observe(*, namespace: str, name: str, spec: Mapping[str, Any], settings: Settings,
                  read_secret: SecretReader | None, etcd: etcd_clients.EtcdClients | None = None) -> Warmth:
    """Read the current assignment and the warm reports from etcd; never raises for etcd trouble."""
    try:
        access = await etcd_access(spec, namespace, read_secret)
        async with etcd_clients.session(access, timeout=settings.etcd_timeout_seconds, clients=etcd) as store:
            placement = await store.read_assignment(namespace, name)
            reports = await store.read_warm(namespace, name) if placement is not None else {}
    except (ValueError, etcd_store.EtcdStoreError) as exc:  # PlacementFormatError is a ValueError
        return Warmth(cond.UNKNOWN, ETCD_UNAVAILABLE, f"cannot read warm reports: {exc}")
    return summarize(placement, reports)


@dataclasses.dataclass
class WarmWatch:
    """What the warm daemon last decided for one CacheShard (in its memo), for the timer to write."""

    warmth: Warmth | None = None
    generation: int | None = None
    """The placement generation ``warmth`` describes (the timer writes it only while it is current)."""
    placement: ps.Placement | None = None
    reports: dict[str, ps.WarmReport] | None = None
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Set by a watch event, or by the timer when the published generation moved on."""

    def decide(self, warmth: Warmth, generation: int | None) -> None:
        self.warmth, self.generation = warmth, generation


async def _collect(reports: AsyncIterator[dict[str, ps.WarmReport]], watch: WarmWatch) -> None:
    try:
        async for found in reports:
            watch.reports = found
            watch.changed.set()
    finally:
        watch.changed.set()  # wake :func:`follow`, which raises this task's error


async def follow(store: etcd_store.EtcdStore, namespace: str, name: str, watch: WarmWatch,
                 published: Callable[[], int | None]) -> None:
    """Decide the warmth into ``watch`` after every change of the warm reports (``store.watch_warm``)
    and whenever :attr:`WarmWatch.changed` is set. The assignment is read again only when the
    generation moved past the one held: ``published()`` (the CacheShard's ``status.placementGeneration``)
    or a pod's report names a newer one (the rebalancer and the learned placement publish too).
    Returns never; raises :class:`~kvshard.etcd_store.EtcdStoreError` when the watch fails or ends."""
    reader = asyncio.create_task(_collect(store.watch_warm(namespace, name), watch))
    try:
        while True:
            await watch.changed.wait()
            watch.changed.clear()
            if reader.done():
                reader.result()
                raise etcd_store.EtcdUnavailableError("the warm report watch ended")
            if watch.reports is None:
                continue
            newest = max([published() or 0, *(r.generation for r in watch.reports.values())])
            if watch.placement is None or watch.placement.generation < newest:
                watch.placement = await store.read_assignment(namespace, name)
            watch.decide(summarize(watch.placement, watch.reports),
                         watch.placement.generation if watch.placement is not None else None)
    finally:
        reader.cancel()


def due(watch: WarmWatch, published: int) -> Warmth | None:
    """The warmth the timer may write for ``status.placementGeneration == published``: None while the
    daemon's decision describes an older generation (then the daemon is asked to look again)."""
    if watch.warmth is None:
        return None
    if watch.generation is not None and watch.generation < published:
        watch.changed.set()
        return None
    return watch.warmth


def current(status: Mapping[str, Any], warmth: Warmth) -> bool:
    """Whether ``status`` already says what ``warmth`` says (then nothing is written)."""
    found = cond.get(status.get("conditions"), cond.WARM) or {}
    same_condition = (found.get("status"), found.get("reason"), found.get("message")) == (
        warmth.status, warmth.reason, warmth.message)
    return same_condition and all(status.get(k) == v for k, v in warmth.fields().items())


def apply(body: MutableMapping[str, Any], warmth: Warmth, generation: int | None) -> None:
    """Write ``warmth`` into ``body`` (a kopf patch function: it mutates the freshest object)."""
    status = body.setdefault("status", {})
    conditions = cond.ensure_all(status.get("conditions"), observed_generation=generation)
    status["conditions"] = cond.set_condition(conditions, cond.WARM, warmth.status, warmth.reason, warmth.message,
                                              observed_generation=generation)
    status.update(warmth.fields())


def reset(status: Mapping[str, Any], generation: int | None, published: int) -> dict[str, Any]:
    """``status`` (a reconcile's outcome) with Warm False right after generation ``published`` went
    out, so nobody reads the previous generation's warmth as this one's until the timer looks."""
    conditions = cond.ensure_all(status.get("conditions"), observed_generation=generation)
    conditions = cond.set_condition(conditions, cond.WARM, cond.FALSE, WARMING,
                                    f"generation {published} published; waiting for the pods' warm reports",
                                    observed_generation=generation)
    return {**status, "conditions": conditions, "warmPods": 0, "warmClusters": 0}
