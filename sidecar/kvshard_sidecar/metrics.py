"""Prometheus metrics of one sidecar (names per docs/architecture.md#metrics).

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
from kvshard_sidecar.pressure import PressureTracker

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
FIDELITY_KL_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
RANK_CORRELATION_BUCKETS = (-0.5, 0.0, 0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


class SidecarMetrics:
    """The sidecar's metric families, registered on their own registry."""

    def __init__(self, model_name: str, store_stats: Callable[[], Mapping[str, TierStats]], *,
                 cacheshard: str, pressure: PressureTracker | None = None) -> None:
        self.model_name = model_name
        self.pressure = pressure or PressureTracker(1, 2.0, 60.0)
        """Waiting/in-flight requests and recent TTFTs → the autoscaler's gauge (read at scrape time)."""
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
        self.cold_items = Counter(
            "kvshard_sidecar_cold_items", "Items a request brought inline (id and text) that the catalog in use "
            "lacks; their blocks are computed on the request and cached", labels, registry=own)
        self.catalog_items = Gauge(
            "kvshard_sidecar_catalog_items", "Items of the catalog version this pod serves", labels, registry=own)
        self.ready = Gauge("kvshard_sidecar_ready", "1 when the model is loaded and requests are served",
                           labels, registry=own)
        # The fidelity guard (:mod:`kvshard_sidecar.serving.shadow`): ``ratio`` is a rung of the fixed ladder
        # (kvshard.blend_policy.RATIO_LADDER) and ``method`` the method in force, so both stay few.
        guard = [*labels, "method", "ratio"]
        self.fidelity_checks = Counter(
            "kvshard_sidecar_fidelity_checks", "Shadow checks of sampled requests against a full prefill, by result "
            "(agree: same chosen candidate; disagree; skipped: shed under load or over the shadow budget)",
            [*labels, "result", "method", "ratio"], registry=own)
        self.fidelity_kl = Histogram(
            "kvshard_sidecar_fidelity_kl", "KL(full prefill || blended) of the first-token distribution, nats",
            guard, buckets=FIDELITY_KL_BUCKETS, registry=own)
        self.fidelity_rank_correlation = Histogram(
            "kvshard_sidecar_fidelity_rank_correlation", "Kendall tau between the blended and the full prefill's "
            "label logits (the candidate ranking)", guard, buckets=RANK_CORRELATION_BUCKETS, registry=own)
        self.shadow_seconds = Counter(
            "kvshard_sidecar_shadow_seconds", "Compute time spent on shadow full prefills (budgeted)", labels,
            registry=own)
        own.register(_StoreCollector(lambda: self.model_name, store_stats))
        own.register(_PressureCollector(lambda: self.model_name, self.pressure))

    def count_request(self, endpoint: str, code: int) -> None:
        self.requests.labels(self.model_name, endpoint, str(code)).inc()


class _PressureCollector(Collector):
    """The autoscaler's gauge and its parts, computed at scrape time (:mod:`kvshard_sidecar.pressure`)."""

    def __init__(self, model_name: Callable[[], str], tracker: PressureTracker) -> None:
        self._model_name = model_name
        self._tracker = tracker

    def collect(self) -> Iterator[Metric]:
        reading = self._tracker.read()
        labels = [self._model_name()]
        for name, doc, value in (
                ("kvshard_sidecar_pressure", "Autoscaling signal: max((waiting + in-flight) / max_concurrency, "
                 "TTFT p90 over the window / TTFT target); 1 = as busy as the pod was sized for", reading.pressure),
                ("kvshard_sidecar_requests_waiting", "Admitted /v1/recommend requests waiting for compute",
                 reading.waiting),
                ("kvshard_sidecar_requests_inflight", "/v1/recommend requests computing now", reading.inflight),
                ("kvshard_sidecar_ttft_p90_seconds", "TTFT p90 over the pressure window (0: no request in it)",
                 reading.ttft_p90_seconds)):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            yield family


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
