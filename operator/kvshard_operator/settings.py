"""The operator's one settings object: flags, then ``KVSHARD_OPERATOR_*`` env, then defaults.

Everything a deployment may tune lives here, with its meaning, declared with the shared helper
(:mod:`kvshard.settings`) as the sidecar's and the router's are: every field is a flag of
``kvshard operator run`` (``--pod-sync-seconds``) and an environment variable
(``KVSHARD_OPERATOR_POD_SYNC_SECONDS``); a flag beats the env, the env beats the default.

The handlers read their settings when :mod:`kvshard_operator.handlers` is imported, because kopf fixes
timer intervals at registration: ``kvshard operator run`` hands its settings over with
:func:`configure` before that import, and without it (``kopf run -m kvshard_operator.handlers``)
:func:`current` reads the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping

from kvshard import settings as settings_lib
from kvshard.settings import setting

ENV_PREFIX = "KVSHARD_OPERATOR_"


@dataclasses.dataclass(frozen=True)
class Settings:
    """How the operator runs. Environment: ``KVSHARD_OPERATOR_<FIELD IN UPPER CASE>``."""

    namespaces: tuple[str, ...] = setting(
        (), "namespace to watch (repeatable or comma-separated); empty: all namespaces (cluster-wide)",
        flags=("--namespace", "-n"), repeatable=True)
    finalizer: str = setting("kvshard.io/etcd-cleanup",
                             "finalizer put on CacheShards so that deleting one removes its etcd keys first")
    annotation_prefix: str = setting("kvshard.io", "prefix of the annotations where kopf keeps handler progress "
                                     "and the last-handled spec")
    peering: bool = setting(False, "kopf peering, for several operator replicas; off: one replica, no peering "
                            "CRDs needed")
    liveness_endpoint: str = setting("http://0.0.0.0:8080/healthz", "liveness probe URL kopf serves; empty disables it")
    metrics_port: int = setting(9090, "port of the Prometheus /metrics endpoint; 0 disables it")
    seed: int = setting(0, "clustering seed, so every operator replica computes the same placement")
    slack_percent: int = setting(10, "how much bigger than n/k a cluster may grow, in percent (balanced k-means)")
    recluster_imbalance_percent: int = setting(
        150, "re-cluster the whole catalog (ids matched to the old ones, so few items move) when a catalog change "
        "leaves the largest cluster above this % of the mean (status.catalog.imbalancePercent); 0: never")
    """Placement caps clusters at ``100 + slack_percent`` % (110 %), and online changes keep that cap for
    additions, so drift beyond it comes from removals and edits draining some clusters and from additions
    once every cluster is full. 150 % leaves that churn alone (a re-clustering moves warm items) but acts
    before one cluster's pods hold half again the mean's blocks."""
    cooccurrence_percent: int = setting(0, "pull items that share user histories this % towards each other "
                                        "before clustering (0: off)")
    large_placement_items: int = setting(
        100_000, "catalogs of at least this many items are clustered by placement_large (centroids trained on a "
        "sample, rows assigned in chunks from float16 vectors) instead of the exact balanced k-means; the "
        "co-occurrence pull applies only below it")
    """Below 100,000 items the exact k-means over one float32 matrix is cheap (≤ 154 MB at 384 dimensions,
    seconds) and is kept for its exactness; at 1 M items it needs 2.4 GB against the sampled one's 0.55 GB
    for 99.6 % of its mean cosine, and from ~3 M items it no longer fits an operator pod at all."""
    kv_bytes_per_token: int = setting(23040, "KV bytes per cached token, to check capacity "
                                      "(SmolLM2-135M: 30 layers·3 kv heads·64·2·bf16)")
    pod_sync_seconds: float = setting(2.0, "how often each CacheShard compares its ready pods with the published "
                                      "placement")
    warm_check_seconds: float = setting(
        0.5, "how often each CacheShard's Warm condition is brought up to date with what its warm daemon decided "
        "(the daemon watches the pods' warm reports in etcd; this tick reads nothing from etcd)")
    catalog_check_seconds: float = setting(
        5.0, "tick of the catalog timer; a CacheShard re-reads its catalog source on the first tick after its own "
        "spec.catalog.refreshSeconds has passed, and re-places only when the catalog changed")
    etcd_quota_bytes: int = setting(
        0, "etcd's --quota-backend-bytes, exported as kvshard_operator_etcd_quota_bytes so the KvshardEtcdNearQuota "
        "alert can compare etcd's DB size with it (the chart sets it from its computed quota); 0: unknown")
    etcd_db_check_seconds: float = setting(30.0, "how often each CacheShard's warm daemon reads etcd's DB size "
                                           "(kvshard_operator_etcd_db_bytes)")
    etcd_timeout_seconds: float = setting(5.0, "deadline of each etcd call; when it passes the shard is Degraded "
                                          "and retried with backoff")
    retry_backoff_seconds: float = setting(2.0, "first retry delay after a transient error (etcd down); doubles up "
                                           "to retry_backoff_max")
    retry_backoff_max: float = setting(60.0, "longest retry delay after transient errors")
    rebalance_check_seconds: float = setting(
        5.0, "tick of the rebalance timer; a CacheShard rebalances on the first tick after its own "
        "spec.rebalance.intervalSeconds has passed, so this bounds how late an interval may start")
    rebalance_window_seconds: float = setting(
        0.0, "PromQL rate() window of the rebalancer; 0: each CacheShard's interval. Keep it at least 4x the "
        "Prometheus scrape interval so every rate has several samples")
    fidelity_check_seconds: float = setting(
        5.0, "tick of the fidelity guard timer: how soon a spec.blend change reaches etcd, and how late a "
        "CacheShard's spec.fidelity.intervalSeconds decision may start")
    prometheus_timeout_seconds: float = setting(5.0, "deadline of each Prometheus query; when it passes the "
                                                "interval is skipped (PrometheusUnavailable)")
    embedding_volume_claim: str = setting(
        "", "ReadWriteMany PVC shared by the operator and its embedding Jobs; empty: the operator embeds catalogs "
        "in process (fine up to ~10^4 items at ~117 items/s on two cores)")
    embedding_root: str = setting("/var/lib/kvshard/embeddings", "where that volume is mounted, in the operator "
                                  "and in the Job's pods")
    embedding_image: str = setting("", "image of the embedding Job's pods (the operator image carries the worker "
                                   "and the model)")
    embedding_cpu: str = setting("1", "CPU request of each embedding pod (the worker is compute-bound: one core each)")
    embedding_memory: str = setting("1Gi", "memory request and limit of each embedding pod (the model is ~90 MB; "
                                    "a chunk is small)")
    embedding_parallelism: int = setting(2, "pods of an embedding Job at once when the CacheShard sets no "
                                         "spec.catalog.embeddings.parallelism")
    embedding_chunk_items: int = setting(1024, "items per content-addressed chunk (one Job index): ~9 s of one "
                                         "worker at 117 items/s")
    embedding_backoff_limit: int = setting(6, "failed pods an embedding Job retries before it gives up (the "
                                           "Kubernetes default)")
    embedding_poll_seconds: float = setting(5.0, "how often a CacheShard waiting on its embedding Job looks at the "
                                            "Job and the volume again")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from ``KVSHARD_OPERATOR_*`` variables over the defaults."""
        return settings_lib.from_sources(cls, None, ENV_PREFIX, environ)

    @classmethod
    def from_args(cls, args: argparse.Namespace | None, environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from the flags of :func:`add_arguments`, then ``KVSHARD_OPERATOR_*``, then the defaults."""
        return settings_lib.from_sources(cls, args, ENV_PREFIX, environ)

    def with_args(self, args: argparse.Namespace) -> Settings:
        """These settings overridden by flags that were given (``None`` means not given)."""
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(self)
                 if getattr(args, f.name, None) is not None}
        return dataclasses.replace(self, **given)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting (``--namespace``/``-n`` also for ``namespaces``); each names its variable."""
    settings_lib.add_arguments(parser, Settings, ENV_PREFIX)


_configured: Settings | None = None


def configure(settings: Settings | None) -> None:
    """Hand ``kvshard operator run``'s settings (flags included) to the handlers, which take them when
    they are imported; ``None`` forgets them (the handlers then read the environment)."""
    global _configured
    _configured = settings


def current() -> Settings:
    """The settings the handlers run with: those :func:`configure` was given, else from the environment."""
    return _configured if _configured is not None else Settings.from_env()
