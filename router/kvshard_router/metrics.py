"""Prometheus metrics of one router (names are a contract: the operator's rebalancer and the
dashboards read them).

Counters and histograms are updated per request. Per-pod state (health, in-flight) and the placement
generation are read from the live state at scrape time by a collector, so a pod that leaves the
placement leaves the output too instead of lingering as a stale labelled gauge.

``kvshard_router_cluster_requests_total{cluster}`` counts, per routed request, each distinct known
cluster among its candidates; ``kvshard_router_cluster_hits_total{cluster}`` those of them the
chosen pod had reported warm and that it answered 2xx for. Per-cluster hit ratio and request rate
are PromQL over the pair.

Every series carries ``cacheshard="<namespace>/<name>"``, the one CacheShard the router follows
(empty without one): cluster ids and pod names are only unique within a shard, so when one
Prometheus scrapes the routers of several shards the rebalancer and the dashboards select by it.
It is added at scrape time to every sample (:mod:`kvshard.metric_labels`) rather than passed at each
``labels()`` call: prometheus_client has no constant labels, and a per-call label is one a future
metric could forget.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvshard.metric_labels import labelled_registry
from kvshard_router.policies import LoadTable
from kvshard_router.state import RouterState

DECISION_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05)
UPSTREAM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
NO_POD = "none"
"""``pod`` label of requests the router answered itself (bad input, no healthy pod)."""


def status_class(status: int) -> str:
    """``200`` → ``"2xx"`` (the ``code`` label keeps cardinality at five values)."""
    return f"{status // 100}xx"


class RouterMetrics:
    """The router's metric families on their own registry."""

    def __init__(self, state: RouterState, load: LoadTable, *, cacheshard: str) -> None:
        own = CollectorRegistry()  # the families below, served through self.registry
        self.registry = labelled_registry(own, cacheshard=cacheshard)
        """What ``/metrics`` serves: every family below with the ``cacheshard`` label added."""
        self.requests = Counter(
            "kvshard_router_requests", "Requests to /v1/recommend by the pod that answered and status class",
            ["pod", "code"], registry=own)
        self.decision = Histogram(
            "kvshard_router_decision_seconds", "Time the routing policy took to choose a pod",
            buckets=DECISION_BUCKETS, registry=own)
        self.retries = Counter(
            "kvshard_router_retries", "Requests re-sent to another pod after a connection failure or 503",
            registry=own)
        self.upstream = Histogram(
            "kvshard_router_upstream_seconds", "Time of one forward to a pod, until its whole answer",
            ["pod"], buckets=UPSTREAM_BUCKETS, registry=own)
        self.cluster_requests = Counter(
            "kvshard_router_cluster_requests",
            "Routed requests per item cluster (each distinct known cluster among a request's candidates)",
            ["cluster"], registry=own)
        self.cluster_hits = Counter(
            "kvshard_router_cluster_hits",
            "Routed requests per item cluster whose answering pod had the cluster warm",
            ["cluster"], registry=own)
        own.register(_StateCollector(state, load))

    def count_clusters(self, counter: Counter, clusters: Iterable[int]) -> None:
        for cluster in clusters:
            counter.labels(str(cluster)).inc()


class _StateCollector(Collector):
    """Per-pod health and in-flight requests and the generation, read at scrape time."""

    def __init__(self, state: RouterState, load: LoadTable) -> None:
        self._state = state
        self._load = load

    def collect(self) -> Iterator[Metric]:
        state = self._state
        healthy = GaugeMetricFamily("kvshard_router_pod_healthy",
                                    "1 when the pod passed its last health check and has a URL, else 0",
                                    labels=["pod"])
        inflight = GaugeMetricFamily("kvshard_router_inflight_requests",
                                     "Requests this router has forwarded to the pod and not yet seen answered",
                                     labels=["pod"])
        for pod in state.pods():
            healthy.add_metric([pod], 1.0 if state.routable(pod) else 0.0)
            inflight.add_metric([pod], self._load.get(pod))
        generation = GaugeMetricFamily("kvshard_router_placement_generation",
                                       "Placement generation the router routes by (0: none yet)")
        generation.add_metric([], float(state.generation))
        yield from (healthy, inflight, generation)
