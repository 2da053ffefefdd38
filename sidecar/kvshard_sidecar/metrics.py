"""Prometheus metrics of one sidecar (names per DESIGN §7).

Counts, never rates: hit *ratios* are PromQL (``rate(hit_tokens) / rate(query_tokens)``), as vLLM
exports its prefix-cache pair. Every series carries ``model_name`` so dashboards join on vLLM's own
metrics, and ``cacheshard="<namespace>/<name>"``, the CacheShard the pod follows (``""`` with static
config, which Prometheus treats as no label): pod names are only unique within a shard, so the
rebalancer selects one shard's sidecars by it when one Prometheus scrapes several shards. It is
added at scrape time to every sample (:mod:`kvshard.metric_labels`): prometheus_client has no constant
labels, and one passed at each ``labels()`` call is one a future metric could forget. Block-store
counters are read from the store at scrape time by a collector, so the store stays free of
Prometheus and nothing is counted twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvshard.metric_labels import labelled_registry
from kvshard_sidecar.blockstore import TierStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)


class SidecarMetrics:
    """The sidecar's metric families, registered on their own registry."""

    def __init__(self, model_name: str, store_stats: Callable[[], Mapping[str, TierStats]], *,
                 cacheshard: str) -> None:
        self.model_name = model_name
        own = CollectorRegistry()  # the families below, served through self.registry
        self.registry = labelled_registry(own, cacheshard=cacheshard)
        """What ``/metrics`` serves: every family below with the ``cacheshard`` label added."""
        labels = ["model_name"]
        self.query_tokens = Counter(
            "kvshard_sidecar_query_tokens", "Prompt tokens of served requests, by segment kind",
            [*labels, "kind"], registry=own)
        self.hit_tokens = Counter(
            "kvshard_sidecar_hit_tokens", "Prompt tokens served from a cached block, by segment kind and tier",
            [*labels, "kind", "tier"], registry=own)
        self.ttft = Histogram(
            "kvshard_sidecar_ttft_seconds", "Time to first token of /v1/recommend", labels,
            buckets=TTFT_BUCKETS, registry=own)
        self.recompute_ratio = Histogram(
            "kvshard_sidecar_recompute_ratio", "Share of prompt tokens recomputed after the check layers",
            labels, buckets=RATIO_BUCKETS, registry=own)
        self.requests = Counter(
            "kvshard_sidecar_requests", "HTTP requests by endpoint and status code",
            [*labels, "endpoint", "code"], registry=own)
        self.prefill_pending = Gauge(
            "kvshard_sidecar_prefill_pending_blocks", "Blocks queued for background prefill", labels,
            registry=own)
        self.prefill_done = Counter(
            "kvshard_sidecar_prefill_blocks", "Blocks computed by background prefill", labels,
            registry=own)
        self.assigned_clusters = Gauge(
            "kvshard_sidecar_assigned_clusters", "Item clusters the followed placement assigns to this pod",
            labels, registry=own)
        self.warm_clusters = Gauge(
            "kvshard_sidecar_warm_clusters", "Assigned item clusters whose every item block is stored here",
            labels, registry=own)
        self.placement_generation = Gauge(
            "kvshard_sidecar_placement_generation", "Placement generation this pod follows (0: none yet)",
            labels, registry=own)
        self.evicted_blocks = Counter(
            "kvshard_sidecar_evicted_blocks", "Item blocks dropped because their cluster was moved off this pod",
            labels, registry=own)
        self.ready = Gauge("kvshard_sidecar_ready", "1 when the model is loaded and requests are served",
                           labels, registry=own)
        own.register(_StoreCollector(lambda: self.model_name, store_stats))

    def count_request(self, endpoint: str, code: int) -> None:
        self.requests.labels(self.model_name, endpoint, str(code)).inc()


class _StoreCollector(Collector):
    """Exports the block store's own counters at scrape time (under the model name of that time:
    it is only known for sure once the model is loaded)."""

    def __init__(self, model_name: Callable[[], str], stats: Callable[[], Mapping[str, TierStats]]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        model_name = self._model_name()
        size = GaugeMetricFamily("kvshard_sidecar_cache_bytes", "Bytes held by each block-store tier",
                                 labels=["model_name", "tier"])
        blocks = GaugeMetricFamily("kvshard_sidecar_cache_blocks", "Blocks held by each block-store tier",
                                   labels=["model_name", "tier"])
        events = CounterMetricFamily("kvshard_sidecar_cache_events",
                                     "Block-store lookups and removals by tier and event "
                                     "(hit, miss, eviction, corrupt)",
                                     labels=["model_name", "tier", "event"])
        for tier, tier_stats in sorted(stats.items()):
            if tier != "peer":
                size.add_metric([model_name, tier], tier_stats.bytes)
                blocks.add_metric([model_name, tier], tier_stats.entries)
            for event, value in (("hit", tier_stats.hits), ("miss", tier_stats.misses),
                                 ("eviction", tier_stats.evictions), ("corrupt", tier_stats.corrupt)):
                events.add_metric([model_name, tier, event], value)
        yield size
        yield blocks
        yield events
