"""Everything the router knows, in one place: placement, warm reports, pod health → one Snapshot.

Three sources change independently — the placement generation (etcd ``current``), the sidecars' warm
reports (etcd ``warm/<pod>``, which also carry each pod's base URL) and the router's own health
checks — and every change must produce a new immutable :class:`~kvshard_router.snapshot.Snapshot`
that request handlers pick up with one attribute read. This class owns that rule and does no I/O,
so the follower and the health checker stay thin and the rule is testable on its own.

Rules:

* A pod is routable only if the placement names it, it has reported a usable ``http(s)://`` URL and
  its last health check passed. Pods start *unverified* (unhealthy) until the first check, as a load
  balancer does with a new backend; the health checker probes new pods at once.
* The item index (the big part of a snapshot) is rebuilt only when ``item_clusters`` changed;
  assignment-only generations and warm/health changes reuse it.
* Warm reports of pods outside the placement are kept (they may join) but not routed to.
* A pod *joins* routing once its report has shown every assigned cluster warm (``warming == 0``,
  with at least one cluster: a pod the operator has not placed yet assigns nothing, so it is
  trivially "done") at least once at its current URL, so a pod added by a scale-out gets traffic only once warm
  (its cold requests would pay full prefills). Once joined it stays joined through later
  rebalances (it serves its other clusters meanwhile); withdrawing the report (a drain, a pod that
  left) or a new URL (a restarted pod elsewhere) makes it cold again. If no healthy pod has joined
  yet (a whole cluster starting), cold pods are routable rather than answering 503.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from urllib.parse import urlsplit

from kvshard.placement_schema import Placement, WarmReport
from kvshard_router.snapshot import ItemIndex, Snapshot, build_snapshot, warm_from_reports

log = logging.getLogger(__name__)


def usable_url(url: str) -> str | None:
    """``url`` without a trailing slash if it is an absolute http(s) URL with a host, else None."""
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        return None
    return url.rstrip("/")


class RouterState:
    """The current snapshot plus the inputs it was built from; mutated only on the event loop."""

    def __init__(self, *, default_item_tokens: int = 16, clock: Callable[[], float] = time.time) -> None:
        self.default_item_tokens = default_item_tokens
        self._clock = clock
        self.placement: Placement | None = None
        self.reports: dict[str, WarmReport] = {}
        self.health: dict[str, bool] = {}
        self.health_reason: dict[str, str] = {}
        self.joined: set[str] = set()
        """Pods that reported every assigned cluster warm at least once at their current URL."""
        self.snapshot: Snapshot | None = None
        self.updated_at: float | None = None
        """Unix time of the last placement or warm-set change (health changes do not count)."""
        self.listeners: list[Callable[[], None]] = []
        """Called after every new snapshot (e.g. to probe pods that just got a URL)."""

    # ------------------------------------------------------------------------------------ views

    @property
    def generation(self) -> int:
        return self.placement.generation if self.placement is not None else 0

    def pods(self) -> tuple[str, ...]:
        """Pods the placement names (sorted), or () before the first placement."""
        return self.snapshot.pods if self.snapshot is not None else ()

    def url(self, pod: str) -> str | None:
        report = self.reports.get(pod)
        return usable_url(report.url) if report is not None else None

    def urls(self) -> dict[str, str]:
        """Pod → base URL for every placement pod that reported a usable one."""
        return {pod: url for pod in self.pods() if (url := self.url(pod)) is not None}

    def warm(self, pod: str) -> frozenset[int]:
        report = self.reports.get(pod)
        return frozenset(report.clusters) if report is not None else frozenset()

    def routable(self, pod: str) -> bool:
        return self._routable_map((pod,))[pod]

    def _routable_map(self, pods: Iterable[str]) -> dict[str, bool]:
        """Routability of ``pods`` — one pass over the joined set, not one per pod."""
        placed = self.placement_pods()
        any_joined = any(p in placed and self._reachable(p) for p in self.joined)
        return {p: self._reachable(p) and (p in self.joined or not any_joined) for p in pods}

    def _reachable(self, pod: str) -> bool:
        return self.url(pod) is not None and self.health.get(pod, False)

    def placement_pods(self) -> set[str]:
        """Every pod the placement names (listed or holding a cluster)."""
        placement = self.placement
        if placement is None:
            return set()
        return set(placement.pods) | {p for holders in placement.assignment.values() for p in holders}

    # ------------------------------------------------------------------------------------ changes

    def reusable_index(self, placement: Placement) -> ItemIndex | None:
        """The current snapshot's item index if ``placement`` maps items exactly as the current one
        (safe to call from a worker thread: it only reads)."""
        current, snapshot = self.placement, self.snapshot
        if current is None or snapshot is None:
            return None
        same = current.item_clusters is placement.item_clusters or current.item_clusters == placement.item_clusters
        return snapshot.items if same else None

    def set_placement(self, placement: Placement, items: ItemIndex | None = None) -> None:
        """Adopt a new generation (``items``: a prebuilt or reused index for its ``item_clusters``)."""
        previous = self.placement
        self.placement = placement
        if previous is None or previous.generation != placement.generation:
            reused = " (item index reused)" if items is not None and self.snapshot is not None and \
                items is self.snapshot.items else ""
            log.info("placement generation %d: %d clusters, %d items, pods %s%s", placement.generation,
                     placement.clusters, len(placement.item_clusters), ", ".join(sorted(placement.pods)) or "-",
                     reused)
        self._rebuild(items)

    def set_reports(self, reports: Mapping[str, WarmReport]) -> None:
        """Adopt the whole warm map (pod → report) as etcd holds it now."""
        new = dict(reports)
        for pod in sorted(set(new) | set(self.reports)):
            old, cur = self.reports.get(pod), new.get(pod)
            if old == cur:
                continue
            if cur is None:
                log.info("pod %s withdrew its warm report", pod)
            elif old is None or old.clusters != cur.clusters or old.url != cur.url:
                bad = "" if usable_url(cur.url) else " (no usable URL: not routable)"
                log.info("pod %s warm for generation %d: clusters %s at %s%s", pod, cur.generation,
                         list(cur.clusters), cur.url or "-", bad)
            if old is not None and cur is not None and old.url != cur.url:
                self.health.pop(pod, None)  # a new address (a restarted pod) is unverified again
            if cur is None or (old is not None and old.url != cur.url):
                self.joined.discard(pod)
            if cur is not None and cur.warming == 0 and cur.clusters and pod not in self.joined:
                self.joined.add(pod)
                log.info("pod %s joins routing: every assigned cluster is warm", pod)
        self.reports = new
        if self.placement is not None:
            self._rebuild(self.snapshot.items if self.snapshot is not None else None)

    def set_health(self, pod: str, healthy: bool, reason: str = "") -> bool:
        """Record one check's outcome; returns True if the pod's health changed (new snapshot)."""
        before = self.health.get(pod)
        self.health[pod] = healthy
        self.health_reason[pod] = "" if healthy else reason
        if before == healthy:
            return False
        if healthy:
            log.info("pod %s is healthy%s", pod, " again" if before is False else "")
        else:
            log.warning("pod %s is unhealthy: %s", pod, reason or "failed")
        if self.snapshot is not None and pod in self.snapshot.pod_index:
            # one pod's health can decide whether cold pods are routable: refresh every pod's mask
            self.snapshot = self.snapshot.with_health(self._routable_map(self.snapshot.pods))
        return True

    def forget_health(self, keep: set[str]) -> None:
        """Drop health records of pods no longer known (they left the placement)."""
        for pod in set(self.health) - keep:
            del self.health[pod]
            self.health_reason.pop(pod, None)

    def _rebuild(self, items: ItemIndex | None) -> None:
        placement = self.placement
        assert placement is not None
        pods = self.placement_pods()
        self.forget_health(pods)
        health = self._routable_map(pods)
        warm = {pod: clusters for pod, clusters in warm_from_reports(self.reports).items() if pod in pods}
        self.snapshot = build_snapshot(placement, warm, health, items=items,
                                       default_item_tokens=self.default_item_tokens)
        self.updated_at = self._clock()
        for listener in self.listeners:
            listener()
