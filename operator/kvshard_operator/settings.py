"""Operator settings: one typed dataclass, read from ``KVSHARD_OPERATOR_*`` and then from flags.

Everything a deployment may tune lives here, with its meaning; nothing else reads the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

ENV_PREFIX = "KVSHARD_OPERATOR_"


@dataclasses.dataclass(frozen=True)
class Settings:
    """How the operator runs. Environment: ``KVSHARD_OPERATOR_<FIELD IN UPPER CASE>``."""

    namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty means cluster-wide."""
    finalizer: str = "kvshard.io/etcd-cleanup"
    """Finalizer put on CacheShards so that deleting one removes its etcd keys first."""
    annotation_prefix: str = "kvshard.io"
    """Prefix of the annotations where kopf keeps handler progress and the last-handled spec."""
    peering: bool = False
    """Kopf peering (for several operator replicas). Off: one replica, no peering CRDs needed."""
    liveness_endpoint: str = "http://0.0.0.0:8080/healthz"
    """Where kopf serves the liveness probe; empty to disable."""
    metrics_port: int = 9090
    """Port of the Prometheus ``/metrics`` endpoint; 0 disables it."""
    seed: int = 0
    """Seed of the clustering, so every operator replica computes the same placement."""
    slack_percent: int = 10
    """How much bigger than n/k a cluster may grow (balanced k-means)."""
    recluster_imbalance_percent: int = 150
    """Re-cluster the whole catalog (ids matched to the old ones, so few items move) when a catalog
    change leaves the largest cluster above this % of the mean (``status.catalog.imbalancePercent``);
    0: never. Placement caps clusters at ``100 + slack_percent`` % (110 %), and online changes keep
    that cap for additions, so drift beyond it comes from removals and edits draining some clusters
    and from additions once every cluster is full. 150 % leaves that churn alone (a re-clustering
    moves warm items) but acts before one cluster's pods hold half again the mean's blocks."""
    cooccurrence_percent: int = 0
    """Pull items that share user histories this % towards each other before clustering (0: off)."""
    large_placement_items: int = 100_000
    """Catalogs of at least this many items are clustered by :mod:`placement_large` (centroids trained
    on a sample, rows assigned in chunks from float16 vectors) instead of the exact balanced k-means
    over one float32 matrix. Below 100,000 items the exact one is cheap (≤ 154 MB of float32 at 384
    dimensions, seconds) and is kept for its exactness; at 1 M items it needs 2.4 GB against the
    sampled one's 0.55 GB for 99.6 % of its mean cosine, and from ~3 M items it no longer fits an
    operator pod at all. The co-occurrence pull applies only below the threshold."""
    kv_bytes_per_token: int = 23040
    """KV bytes per cached token, to check capacity (SmolLM2-135M: 30 layers·3 kv heads·64·2·bf16)."""
    pod_sync_seconds: float = 2.0
    """How often each CacheShard compares its ready pods with the published placement."""
    warm_check_seconds: float = 2.0
    """How often each CacheShard reads its pods' warm reports from etcd (the ``Warm`` condition)."""
    catalog_check_seconds: float = 5.0
    """Tick of the catalog timer; a CacheShard re-reads its catalog source on the first tick after its
    own ``spec.catalog.refreshSeconds`` has passed, and re-places only when the catalog changed."""
    etcd_timeout_seconds: float = 5.0
    """Deadline of each etcd call; when it passes the shard is Degraded and retried with backoff."""
    retry_backoff_seconds: float = 2.0
    """First retry delay after a transient error (etcd down); doubles up to ``retry_backoff_max``."""
    retry_backoff_max: float = 60.0
    """Longest retry delay after transient errors."""
    rebalance_check_seconds: float = 5.0
    """Tick of the rebalance timer; a CacheShard rebalances on the first tick after its own
    ``spec.rebalance.intervalSeconds`` has passed, so this bounds how late an interval may start."""
    rebalance_window_seconds: float = 0.0
    """PromQL ``rate()`` window of the rebalancer; 0 means each CacheShard's interval. Keep it at
    least 4× the Prometheus scrape interval so every rate has several samples."""
    fidelity_check_seconds: float = 5.0
    """Tick of the fidelity guard timer: how soon a spec.blend change reaches etcd, and how late a
    CacheShard's ``spec.fidelity.intervalSeconds`` decision may start."""
    prometheus_timeout_seconds: float = 5.0
    """Deadline of each Prometheus query; when it passes the interval is skipped (PrometheusUnavailable)."""
    embedding_volume_claim: str = ""
    """ReadWriteMany PVC shared by the operator and its embedding Jobs (:mod:`embed_job`); empty: the
    operator embeds catalogs in process (fine up to ~10⁴ items at ~117 items/s on two cores)."""
    embedding_root: str = "/var/lib/kvshard/embeddings"
    """Where that volume is mounted, in the operator and in the Job's pods."""
    embedding_image: str = ""
    """Image of the embedding Job's pods (the operator image carries the worker and the model)."""
    embedding_cpu: str = "1"
    """CPU request of each embedding pod (the worker is compute-bound: one core each)."""
    embedding_memory: str = "1Gi"
    """Memory request and limit of each embedding pod (the model is ~90 MB; a chunk is small)."""
    embedding_parallelism: int = 2
    """Pods of an embedding Job at once when the CacheShard sets no ``spec.catalog.embeddings.parallelism``."""
    embedding_chunk_items: int = 1024
    """Items per content-addressed chunk (one Job index): ~9 s of one worker at 117 items/s."""
    embedding_backoff_limit: int = 6
    """Failed pods an embedding Job retries before it gives up (the Kubernetes default)."""
    embedding_poll_seconds: float = 5.0
    """How often a CacheShard waiting on its embedding Job looks at the Job and the volume again."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from ``KVSHARD_OPERATOR_*`` variables over the defaults."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = env.get(ENV_PREFIX + field.name.upper())
            if raw is not None:
                values[field.name] = _parse(field.type, raw, field.name)
        return cls(**values)

    def with_args(self, args: argparse.Namespace) -> Settings:
        """These settings overridden by flags that were given (``None`` means not given)."""
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(self)
                 if getattr(args, f.name, None) is not None}
        if "namespaces" in given:
            given["namespaces"] = tuple(given["namespaces"])
        return dataclasses.replace(self, **given)


def _parse(kind: Any, raw: str, name: str) -> Any:
    kind = str(kind)
    try:
        if kind.startswith("tuple"):
            return tuple(part.strip() for part in raw.split(",") if part.strip())
        if kind == "bool":
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        return raw
    except ValueError as exc:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {kind}") from exc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for the settings users change most; the rest come from the environment."""
    parser.add_argument("--namespace", "-n", dest="namespaces", action="append",
                        help="namespace to watch (repeatable; default: all namespaces)")
    parser.add_argument("--peering", action=argparse.BooleanOptionalAction, default=None,
                        help="enable kopf peering for several replicas (default: off)")
    parser.add_argument("--liveness-endpoint", dest="liveness_endpoint", default=None,
                        help="liveness probe URL to serve (default http://0.0.0.0:8080/healthz)")
    parser.add_argument("--metrics-port", dest="metrics_port", type=int, default=None,
                        help="port of /metrics (default 9090, 0 disables)")
    parser.add_argument("--seed", type=int, default=None, help="clustering seed (default 0)")
    parser.add_argument("--recluster-imbalance-percent", dest="recluster_imbalance_percent", type=int,
                        default=None, help="re-cluster the catalog when a change leaves the largest cluster "
                        "above this %% of the mean (default 150, 0 never)")
