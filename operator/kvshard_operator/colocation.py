"""Co-locate clusters that are requested together, within capacity, load balance and a movement
budget (pure).

Item clusters come from item text, but a request's candidates come from retrieval: clusters that
are asked for together often live on different pods, and then no pod holds much of a request's
blocks. The routers count co-requested cluster pairs (a bounded sketch, :mod:`kvshard_router.corequest`:
per pair the chance that two of a request's candidates fall in it) and each cluster's share of the
requests. This module turns them into a better assignment: balanced graph partitioning refined in the
Kernighan–Lin style — nodes are clusters weighted by their request share, edges are co-request
weights, parts are pods.

**Why balance is part of the objective.** The affinity router sends a request to the pod holding
most of it *unless that pod is busy* (one queued request outweighs a whole request's cached
tokens). Packing the topics traffic asks for together onto pods without looking at load makes a few
pods the best holder of most requests; they saturate and the requests go to whatever pod is idle,
so locality does not improve however well the graph is cut (measured: the best pod of 43 % of the
requests was one pod of sixteen). So a swap may not push a pod's request share above ``max_load`` ×
the mean (or the heaviest single cluster, which no placement without replication can split), and
while a pod is above it, swaps that bring it down come first.

Only *swaps* are applied: cluster ``a`` on pod P trades places with ``b`` on pod Q. A swap keeps
every pod's cluster count — so whatever capacity the placement respected it still respects — and
moves exactly two clusters, which the movement budget counts. Each round takes the best swap (most
overload removed, then most co-request weight brought onto one pod net of weight split apart), and
stops when no swap gains more than ``min_gain`` or the budget is spent. The caller applies the
result make-before-break like any placement change (new holders warm first; the old holder serves
until the routers see the new one warm).

Kept apart from :mod:`kvshard_operator.placement` on purpose: it only reads an assignment and
returns another.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

Pair = tuple[int, int]
K = TypeVar("K", bound=Hashable)
_EPS = 1e-12


@dataclass(frozen=True)
class Colocation:
    assignment: dict[int, tuple[str, ...]]
    moved: tuple[int, ...]
    """Clusters whose primary holder changed (two per swap)."""
    gain: float
    """Co-request weight newly kept on one pod (negative where balance cost some)."""
    local_before: float
    local_after: float
    """Share of the pair weight whose two clusters share a pod, before and after."""
    load_before: float = 1.0
    load_after: float = 1.0
    """Heaviest pod's request share over the mean (1.0 when no rates were given)."""


def local_share(primary: Mapping[int, str], pairs: Mapping[Pair, float]) -> float:
    """Share of the co-request weight whose two clusters have the same primary pod."""
    total = sum(pairs.values())
    kept = sum(w for (a, b), w in pairs.items() if primary.get(a) is not None and primary.get(a) == primary.get(b))
    return kept / total if total > 0 else 0.0


def remember(previous: Mapping[K, float], fresh: Mapping[K, float], *, keep: float,
             limit: int) -> dict[K, float]:
    """A decayed graph after one more interval: ``keep`` × the old weights + the interval's, bounded
    to the ``limit`` heaviest entries (works for pair weights and for per-cluster rates alike).

    One interval's sample is noisy; swapping on it alone undoes last interval's swaps as often as it
    improves on them (each swap costing two warm-ups). A decayed sum keeps what traffic keeps asking
    for and still forgets a topic that went away, at the rate ``keep`` sets."""
    if not 0.0 <= keep < 1.0:
        raise ValueError("keep must be in [0, 1)")
    merged = {p: w * keep for p, w in previous.items()}
    for key, w in fresh.items():
        merged[key] = merged.get(key, 0.0) + w
    if len(merged) > limit:
        merged = dict(heapq.nlargest(limit, merged.items(), key=lambda kv: kv[1]))
    return merged


def _heaviest_over_mean(load: Mapping[str, float]) -> float:
    mean = sum(load.values()) / len(load) if load else 0.0
    return max(load.values()) / mean if mean > 0 else 1.0


def colocate(assignment: Mapping[int, tuple[str, ...]], pairs: Mapping[Pair, float], *,
             max_moves: int, rates: Mapping[int, float] | None = None, max_load: float = 1.25,
             min_gain: float = 0.0) -> Colocation:
    """Swap clusters between pods (primary holders; extra replicas stay), moving at most
    ``max_moves`` clusters.

    ``rates`` is each cluster's share of the requests (clusters not named count 0); without it only
    the co-request weight is looked at. ``min_gain`` is the share of the total pair weight a swap must
    bring onto one pod to be worth its two warm-ups (hysteresis against the sketch's noise)."""
    primary = {c: holders[0] for c, holders in assignment.items() if holders}
    rate = {c: float(rates.get(c, 0.0)) if rates is not None else 0.0 for c in primary}
    neighbours: dict[int, dict[int, float]] = collections.defaultdict(dict)
    for (a, b), w in pairs.items():
        if a != b and a in primary and b in primary and w > 0:
            neighbours[a][b] = neighbours[a].get(b, 0.0) + w
            neighbours[b][a] = neighbours[b].get(a, 0.0) + w
    on_pod: dict[str, set[int]] = collections.defaultdict(set)
    load: dict[str, float] = collections.defaultdict(float)
    for c, pod in primary.items():
        on_pod[pod].add(c)
        load[pod] += rate[c]
    before = local_share(primary, pairs)
    load_before = _heaviest_over_mean(load)
    mean = sum(load.values()) / len(load) if load else 0.0
    cap = max(max_load * mean, max(rate.values(), default=0.0))

    # weight[c][pod]: co-request weight between c and the clusters on pod (kept up to date per swap)
    weight: dict[int, dict[str, float]] = {c: collections.defaultdict(float) for c in primary}
    for c, edges in neighbours.items():
        for n, w in edges.items():
            weight[c][primary[n]] += w

    def over(value: float) -> float:
        return max(0.0, value - cap)

    def relocate(c: int, source: str, target: str) -> None:
        primary[c] = target
        on_pod[source].discard(c)
        on_pod[target].add(c)
        load[source] -= rate[c]
        load[target] += rate[c]
        for n, w in neighbours[c].items():
            weight[n][source] -= w
            weight[n][target] += w

    def swap_gain(a: int, c: int) -> float:
        pa, pc = primary[a], primary[c]
        return (weight[a][pc] - weight[a][pa] + weight[c][pa] - weight[c][pc]
                - 2 * neighbours[a].get(c, 0.0))

    def relief(a: int, c: int) -> float:
        """Overload the swap removes (negative: adds)."""
        pa, pc = primary[a], primary[c]
        new_a, new_c = load[pa] - rate[a] + rate[c], load[pc] - rate[c] + rate[a]
        return over(load[pa]) + over(load[pc]) - over(new_a) - over(new_c)

    moved: set[int] = set()
    gain_total = 0.0
    threshold = max(_EPS, min_gain * sum(pairs.values()))
    while len(moved) + 2 <= max_moves:
        best: tuple[float, float, int, int] | None = None  # (relief, gain, a, c)
        overloaded = [p for p in on_pod if over(load[p]) > _EPS]
        if overloaded:  # balance first: any swap that takes load off an overloaded pod
            for p in overloaded:
                for a in on_pod[p] - moved:
                    for q, clusters in on_pod.items():
                        if q == p or load[q] >= load[p]:
                            continue
                        for c in clusters - moved:
                            r = relief(a, c)
                            if r > _EPS:
                                key = (r, swap_gain(a, c), a, c)
                                if best is None or key[:2] > best[:2]:
                                    best = key
        if best is None:
            for a, edges in neighbours.items():
                if a in moved:
                    continue
                pa = primary[a]
                for q in {primary[b] for b in edges} - {pa}:
                    if weight[a][q] - weight[a][pa] <= 0:
                        continue
                    for c in on_pod[q] - moved:  # the cluster that goes to a's pod in exchange
                        gain = swap_gain(a, c)
                        if gain > threshold and relief(a, c) >= -_EPS and (best is None or gain > best[1]):
                            best = (0.0, gain, a, c)
        if best is None:
            break
        _, gain, a, c = best
        pa, pc = primary[a], primary[c]
        relocate(a, pa, pc)
        relocate(c, pc, pa)
        moved.update((a, c))
        gain_total += gain
    result: dict[int, tuple[str, ...]] = {}
    for c, holders in assignment.items():
        if c in primary and primary[c] != holders[0]:
            rest = tuple(h for h in holders[1:] if h != primary[c])
            result[c] = (primary[c], *rest)
        else:
            result[c] = tuple(holders)
    return Colocation(result, tuple(sorted(moved)), gain_total, before, local_share(primary, pairs),
                      load_before, _heaviest_over_mean(load))
