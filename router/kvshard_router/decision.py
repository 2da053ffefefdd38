"""One routing decision with one item lookup: what both front ends (HTTP router, GIE endpoint picker) run.

Looking a request's candidates up in the snapshot's item index is the most expensive step of a
decision at 10 M items, and the router used to do it four times per request: in the policy's choice,
for the chosen pod's cached-token count (the work the backlog adds), for the per-cluster metrics and
co-request counts, and when the answer came (the affinity policy's recently-served blocks). Here it is
done once: :class:`Lookup` carries the candidates' clusters, :class:`Decision` the per-pod cached
tokens computed from them, and everything after the choice reads those.

A lookup stays valid for any snapshot that shares its item index (health, warm-set and
assignment-only generations reuse the index), so a retry on a newer snapshot reuses it too; a
generation that re-mapped items gets a fresh lookup. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvshard_router.policies import (
    AffinityPolicy,
    LoadView,
    RouteRequest,
    RoutingPolicy,
    cached_tokens,
    request_tokens,
)
from kvshard_router.snapshot import FloatArray, IntArray, ItemIndex, Snapshot


@dataclass(frozen=True, slots=True, eq=False)
class Lookup:
    """A request's candidates looked up once in one item index (the request's only lookup)."""

    request: RouteRequest
    index: ItemIndex
    clusters: IntArray
    """Cluster of each candidate in prompt order, −1 for an item the placement does not know."""

    @classmethod
    def of(cls, request: RouteRequest, snapshot: Snapshot) -> Lookup:
        return cls(request, snapshot.items, snapshot.clusters_of(request.items))

    def valid_for(self, snapshot: Snapshot) -> bool:
        """Whether ``snapshot`` maps items exactly as the index this lookup used (same index object)."""
        return snapshot.items is self.index

    def distinct_clusters(self) -> list[int]:
        """The distinct known clusters among the candidates (what the per-cluster metrics count)."""
        found = self.clusters
        return [int(c) for c in np.unique(found[found >= 0])]


@dataclass(frozen=True, slots=True, eq=False)
class Decision:
    """The outcome of one decision: the pod (None: no eligible pod) and what it was computed from."""

    pod: str | None
    snapshot: Snapshot
    lookup: Lookup
    held: FloatArray
    """Per snapshot pod: tokens of the request's blocks it holds by placement (history included when
    replicated everywhere) — the policy's cache term and the chosen pod's work estimate."""
    total_tokens: int

    def cached_on(self, pod: str) -> float:
        """Tokens of the request the pod holds by placement (0 for a pod outside the snapshot)."""
        j = self.snapshot.pod_index.get(pod)
        return float(self.held[j]) if j is not None else 0.0


def decide(policy: RoutingPolicy, request: RouteRequest, snapshot: Snapshot, load: LoadView,
           lookup: Lookup | None = None) -> Decision:
    """Choose a pod for ``request`` on ``snapshot``; ``lookup`` (an earlier decision's, e.g. before a
    retry) is reused when it is still valid for ``snapshot``, so the items are looked up at most once."""
    if lookup is None or not lookup.valid_for(snapshot):
        lookup = Lookup.of(request, snapshot)
    held = cached_tokens(request, snapshot, lookup.clusters)
    if isinstance(policy, AffinityPolicy):
        pod = policy.choose(request, snapshot, load, clusters=lookup.clusters, held=held)
    else:
        pod = policy.choose(request, snapshot, load)
    return Decision(pod, snapshot, lookup, held, request_tokens(request, snapshot))


def record_served(policy: RoutingPolicy, pod: str, lookup: Lookup, snapshot: Snapshot) -> None:
    """``pod`` answered the looked-up request (2xx): the affinity policy remembers the blocks it now
    holds, from the lookup when it is valid for ``snapshot``."""
    if isinstance(policy, AffinityPolicy):
        clusters = lookup.clusters if lookup.valid_for(snapshot) else None
        policy.served(pod, lookup.request, snapshot, clusters=clusters)
    elif (served := getattr(policy, "served", None)) is not None:  # another policy that learns from answers
        served(pod, lookup.request, snapshot)
