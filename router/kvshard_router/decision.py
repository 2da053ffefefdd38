"""One routing decision with one item lookup: what both front ends (HTTP router, GIE endpoint picker) run.

Looking a request's candidates up in the snapshot's item index is the most expensive step of a
decision at 10 M items, and the router used to do it four times per request: in the policy's choice,
for the chosen pod's cached-token count (the work the backlog adds), for the per-cluster metrics and
co-request counts, and when the answer came (the affinity policy's recently-served blocks). Here it is
done once — for the affinity policy inside its compiled decision (:mod:`kvshard_router.kernels`), which
hands the clusters back: :class:`Lookup` carries them, :class:`Decision` the chosen pod's cached tokens,
and everything after the choice reads those.

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
from kvshard_router.snapshot import IntArray, ItemIndex, Snapshot


@dataclass(slots=True, eq=False)  # not frozen: a frozen __init__ costs ~0.3 µs a field, per decision
class Lookup:
    """A request's candidates looked up once in one item index (the request's only lookup; never mutated)."""

    request: RouteRequest
    index: ItemIndex
    clusters: IntArray
    """Cluster of each candidate in prompt order, −1 for an item the placement does not know."""

    def valid_for(self, snapshot: Snapshot) -> bool:
        """Whether ``snapshot`` maps items exactly as the index this lookup used (same index object)."""
        return snapshot.items is self.index

    def distinct_clusters(self) -> list[int]:
        """The distinct known clusters among the candidates (what the per-cluster metrics count)."""
        found = self.clusters
        return [int(c) for c in np.unique(found[found >= 0])]


@dataclass(slots=True, eq=False)  # not frozen, as Lookup
class Decision:
    """The outcome of one decision: the pod (None: no eligible pod) and what it was computed from (never
    mutated)."""

    pod: str | None
    snapshot: Snapshot
    lookup: Lookup
    cached: float
    """Tokens of the request ``pod`` holds by placement (history included when replicated everywhere):
    its work estimate's cached share; 0 without a pod."""
    total_tokens: int


def decide(policy: RoutingPolicy, request: RouteRequest, snapshot: Snapshot, load: LoadView,
           lookup: Lookup | None = None) -> Decision:
    """Choose a pod for ``request`` on ``snapshot``; ``lookup`` (an earlier decision's, e.g. before a
    retry) is reused when it is still valid for ``snapshot``, so the items are looked up at most once."""
    known = lookup.clusters if lookup is not None and lookup.valid_for(snapshot) else None
    if isinstance(policy, AffinityPolicy):  # it looks the items up inside its compiled decision
        pod, cached, clusters = policy.decide(request, snapshot, load, known)
    else:
        clusters = known if known is not None else snapshot.clusters_of(request.items)
        pod = policy.choose(request, snapshot, load)
        cached = 0.0 if pod is None else float(cached_tokens(request, snapshot, clusters)[snapshot.pod_index[pod]])
    if lookup is None or known is None:
        lookup = Lookup(request, snapshot.items, clusters)
    return Decision(pod, snapshot, lookup, cached, request_tokens(request, snapshot))


def record_served(policy: RoutingPolicy, pod: str, lookup: Lookup, snapshot: Snapshot) -> None:
    """``pod`` answered the looked-up request (2xx): the affinity policy remembers the blocks it now
    holds, from the lookup when it is valid for ``snapshot``."""
    if isinstance(policy, AffinityPolicy):
        clusters = lookup.clusters if lookup.valid_for(snapshot) else None
        policy.served(pod, lookup.request, snapshot, clusters=clusters)
    elif (served := getattr(policy, "served", None)) is not None:  # another policy that learns from answers
        served(pod, lookup.request, snapshot)
