"""Which clusters are requested together: a bounded sketch the router keeps per interval.

The operator's colocation (``kvshard_operator.colocation``) needs co-request weights of cluster
pairs. A Prometheus label per pair would be a cardinality bomb (clusters² series); instead each
router keeps at most ``capacity`` pairs in memory and publishes the top ones each interval (to etcd,
under a lease, so a router that died stops counting). Memory stays bounded by construction: when
the table is full the lighter half is dropped (pairs asked for often survive, rare ones are
forgotten — a heavy-hitters table).

**Weights.** A request whose candidates fall ``n_c`` per cluster (``N`` in all, shares ``s_c =
n_c / N``) adds ``s_a · s_b`` to each pair (a, b). That is the chance that two of its candidates
drawn at random lie in a and b — exactly how much putting a and b on one pod raises the share of
the request one pod can serve (the affinity router sends it to the pod holding most of it). A
plain count per pair (or ``1 / (m − 1)`` each) would weigh the one stray candidate in a twelfth
cluster like the request's main cluster, and a partition of that graph keeps stray pairs together
instead of the clusters that carry the request. Summed over pairs, one request adds at most ½.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvshard.corequest_schema import CoRequestReport

Pair = tuple[int, int]


def request_shares(clusters: Iterable[int]) -> dict[int, float]:
    """Each cluster's share ``s_c`` of one request's candidates (negative ids — items the router
    does not know — are skipped)."""
    counts = collections.Counter(c for c in clusters if c >= 0)
    total = sum(counts.values())
    return {c: n / total for c, n in counts.items()}


def request_pairs(shares: Mapping[int, float], max_clusters: int = 24) -> dict[Pair, float]:
    """The pair weights one request adds: ``s_a · s_b`` for its ``max_clusters`` heaviest clusters."""
    if len(shares) < 2:
        return {}
    heavy = sorted(sorted(shares.items(), key=lambda kv: (-kv[1], kv[0]))[:max_clusters])
    return {(a, b): sa * sb for (a, sa), (b, sb) in itertools.combinations(heavy, 2)}


@dataclass(frozen=True)
class Interval:
    """One interval's counts: pair weights, per-cluster request shares, and the requests seen."""

    pairs: dict[Pair, float]
    rates: dict[int, float]
    requests: int


class CoRequestSketch:
    """Co-request weights of cluster pairs over one interval (at most ``capacity`` of them), and each
    cluster's share of the requests (Σ ``s_c``; the operator balances pods on it)."""

    def __init__(self, capacity: int = 4096, *, max_clusters_per_request: int = 24) -> None:
        if capacity < 2 or max_clusters_per_request < 2:
            raise ValueError("capacity and max_clusters_per_request must be >= 2")
        self.capacity = capacity
        self.max_clusters = max_clusters_per_request
        self.counts: dict[Pair, float] = {}
        self.rates: dict[int, float] = {}
        self.requests = 0

    def add(self, clusters: Iterable[int]) -> None:
        """Count one request: the cluster of each of its candidates (repeats weigh)."""
        self.requests += 1
        shares = request_shares(clusters)
        rates = self.rates
        for c, s in shares.items():
            rates[c] = rates.get(c, 0.0) + s
        counts = self.counts
        for pair, w in request_pairs(shares, self.max_clusters).items():
            counts[pair] = counts.get(pair, 0.0) + w
        if len(counts) > self.capacity:
            self.counts = dict(heapq.nlargest(self.capacity // 2, counts.items(), key=lambda kv: kv[1]))
        if len(rates) > self.capacity:
            self.rates = dict(heapq.nlargest(self.capacity // 2, rates.items(), key=lambda kv: kv[1]))

    def top(self, n: int) -> list[tuple[Pair, float]]:
        """The ``n`` heaviest pairs, heaviest first (what is published each interval)."""
        return heapq.nsmallest(n, self.counts.items(), key=lambda kv: (-kv[1], kv[0]))

    def top_rates(self, n: int) -> list[tuple[int, float]]:
        """The ``n`` most requested clusters with their shares, heaviest first."""
        return heapq.nsmallest(n, self.rates.items(), key=lambda kv: (-kv[1], kv[0]))

    def take(self, router: str, top: int, at: float) -> CoRequestReport:
        """The interval's ``top`` heaviest pairs and clusters as the report to publish; the tables
        start empty for the next interval."""
        report = CoRequestReport(router, dict(self.top(top)), dict(self.top_rates(top)), self.requests, at)
        self.reset()
        return report

    def reset(self) -> Interval:
        """The interval's counts; the tables start empty for the next interval."""
        interval = Interval(self.counts, self.rates, self.requests)
        self.counts, self.rates, self.requests = {}, {}, 0
        return interval

