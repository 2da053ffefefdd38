"""Operator metrics, ``kvshard_operator_*`` (docs/architecture.md#metrics): counts and durations, ratios in PromQL.

Per-CacheShard series carry one label, ``cacheshard="<namespace>/<name>"`` (:func:`shard_label`);
deleting a CacheShard removes them all (:func:`forget_shard`), so a deleted shard leaves no stale gauge.
"""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

PLACEMENT_SECONDS = Histogram(
    "kvshard_operator_placement_seconds",
    "Time to compute one placement (catalog, embeddings, clustering, assignment).",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
REBALANCES = Counter(
    "kvshard_operator_rebalances_total",
    "Placements published, by what triggered them.",
    ["reason"],  # created | spec | pods | retry | resume | rebalance
)
REBALANCE_ACTIONS = Counter(
    "kvshard_operator_rebalance_actions_total",
    "Replica changes published by the hot/cold rebalancer, by kind.",
    ["kind"],  # replicate | move | drop
)
REBALANCE_INTERVALS = Counter(
    "kvshard_operator_rebalance_intervals_total",
    "Rebalance intervals evaluated, by outcome (the Rebalancing condition's reason).",
    ["outcome"],  # Rebalanced | Balanced | NoTraffic | PrometheusUnavailable | EtcdUnavailable | GenerationConflict
)
MOVED_REPLICAS = Counter(
    "kvshard_operator_moved_replicas_total",
    "Cluster replicas placed on a pod that did not hold them (each costs a cache warm-up).",
)
PUBLISH_ERRORS = Counter(
    "kvshard_operator_publish_errors_total",
    "Failed attempts to publish a placement, by kind.",
    ["kind"],  # unavailable | conflict | auth | tls
)
INVALID = Counter(
    "kvshard_operator_invalid_cacheshards_total",
    "Reconciliations stopped by a user-input error, by condition reason.",
    ["reason"],
)
PLACEMENT_GENERATION = Gauge(
    "kvshard_operator_placement_generation",
    "The placement generation last published, per CacheShard (cacheshard=\"<namespace>/<name>\", as on "
    "the router's and the sidecars' series).",
    ["cacheshard"],
)
FIDELITY_DECISIONS = Counter(
    "kvshard_operator_fidelity_decisions",
    "Fidelity controller intervals, by reason (BelowTarget, AboveTarget, MeetsTarget, NotYetShown, AtMaxRatio, "
    "InsufficientSamples, PrometheusUnavailable).",
    ["reason"],
)
BLEND_RATIO = Gauge(
    "kvshard_operator_blend_ratio",
    "The recompute ratio in force (published to etcd), per CacheShard.",
    ["cacheshard"],
)
FIDELITY_TARGET = Gauge(
    "kvshard_operator_fidelity_target",
    "spec.fidelity.targetAgreementPercent as a fraction, per CacheShard (dashboards and alerts compare with it).",
    ["cacheshard"],
)
FIDELITY_MAX_RATIO = Gauge(
    "kvshard_operator_fidelity_max_ratio",
    "spec.fidelity.maxRatioPercent as a fraction, per CacheShard.",
    ["cacheshard"],
)
ETCD_CONNECTIONS_OPENED = Counter(
    "kvshard_operator_etcd_connections_opened",
    "etcd connections the operator opened (one per distinct etcd access, again after an outage; "
    "not one per tick).",
)
PLACEMENT_BYTES_WRITTEN = Gauge(
    "kvshard_operator_placement_bytes_written",
    "Bytes (keys + values) the last published generation wrote to etcd, per CacheShard.",
    ["cacheshard"],
)
ETCD_DB_BYTES = Gauge(
    "kvshard_operator_etcd_db_bytes",
    "etcd's backend database size in bytes, as the CacheShard's etcd reports it (at most every 30 s).",
    ["cacheshard"],
)
ETCD_QUOTA_BYTES = Gauge(
    "kvshard_operator_etcd_quota_bytes",
    "etcd's backend quota (--quota-backend-bytes) the operator was told (setting etcd_quota_bytes); 0: unknown.",
)


PER_SHARD: tuple[Gauge, ...] = (PLACEMENT_GENERATION, BLEND_RATIO, FIDELITY_TARGET, FIDELITY_MAX_RATIO,
                                PLACEMENT_BYTES_WRITTEN, ETCD_DB_BYTES)
"""Every metric labelled by CacheShard (its only label, ``cacheshard``)."""


def shard_label(namespace: str, name: str) -> str:
    """The ``cacheshard`` label value of a CacheShard, as on the router's and the sidecars' series."""
    return f"{namespace}/{name}"


def forget_shard(namespace: str, name: str) -> None:
    """Remove every series of a deleted CacheShard from every per-CacheShard metric (absent ones are fine)."""
    shard = shard_label(namespace, name)
    for metric in PER_SHARD:
        with contextlib.suppress(KeyError):  # older prometheus_client raised for a label set never used
            metric.remove(shard)
