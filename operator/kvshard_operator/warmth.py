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

The handler applies :func:`apply` as a kopf patch *function*: kopf turns it into a JSON patch of
exactly these fields against the freshest object, guarded by its resourceVersion, so this timer
never overwrites conditions a concurrent reconcile just wrote.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any

from kvshard import etcd_store
from kvshard import placement_schema as ps
from kvshard_operator import conditions as cond
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
                  read_secret: SecretReader | None) -> Warmth:
    """Read the current assignment and the warm reports from etcd; never raises for etcd trouble."""
    try:
        access = await etcd_access(spec, namespace, read_secret)
        async with access.store(timeout=settings.etcd_timeout_seconds) as store:
            placement = await store.read_assignment(namespace, name)
            reports = await store.read_warm(namespace, name) if placement is not None else {}
    except (ValueError, etcd_store.EtcdStoreError) as exc:  # PlacementFormatError is a ValueError
        return Warmth(cond.UNKNOWN, ETCD_UNAVAILABLE, f"cannot read warm reports: {exc}")
    return summarize(placement, reports)


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
