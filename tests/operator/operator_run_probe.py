"""Run ``kvshard operator run <flags>`` in this (fresh) process with no Kubernetes API, then show where each
flag group ended up; prints one JSON line. Used by ``test_operator_settings.py`` (one subprocess for all).

``kopf.run`` and the metrics server are replaced by recorders, so the CLI goes through exactly the path
a real run takes (parser → ``main.configure`` → handlers imported → kopf started) and stops there. Then
each group is followed to what uses it, with the handlers' own ``SETTINGS``:

* kopf: ``kopf.run``'s arguments, the metrics port, and the startup handler on a fresh OperatorSettings;
* timers: the kopf registry's intervals and initial delays; the rebalancer's PromQL window and the
  Prometheus deadline (a fake store and Prometheus);
* placement: the clustering the reconciler runs (``clustering.cluster``: seed, slack, co-occurrence, the
  large-catalog threshold), whether a catalog change re-clusters (``clustering.catalog_labels``), the KV bytes
  per cluster;
* etcd & retry: the delete handler's etcd deadline and its retry delays;
* embedding: the Job the reconciler creates for a catalog (``reconcile._embed`` with a fake Job API).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
from typing import Any

import kopf
import numpy as np
import prometheus_client

from kvshard import cli, etcd_store

LOG = logging.getLogger("operator_run_probe")
SEEN: dict[str, Any] = {}


def fake_kopf_run(**kwargs: Any) -> None:
    SEEN["kopf_run"] = {k: kwargs[k] for k in ("clusterwide", "namespaces", "standalone", "liveness_endpoint")}


def fake_metrics_server(port: int, *_: Any, **__: Any) -> None:
    SEEN["metrics_port"] = port


class FakeStore:
    """An etcd that records its deadline, is down for deletes, and has a placement for the rebalancer."""

    timeouts: list[float] = []

    def __init__(self, endpoints: Any, *, timeout: float, **_: Any) -> None:
        FakeStore.timeouts.append(timeout)

    async def __aenter__(self) -> FakeStore:
        return self

    async def __aexit__(self, *_: Any) -> None:
        return None

    async def delete_all(self, namespace: str, name: str) -> int:
        raise etcd_store.EtcdUnavailableError("etcd down (probe)")

    async def read_current(self, namespace: str, name: str) -> object:
        return object()  # a placement is published: the rebalancer goes on to Prometheus


class FakePrometheus:
    asked: dict[str, float] = {}

    def __init__(self, url: str, *, timeout: float) -> None:
        FakePrometheus.asked["timeout"] = timeout

    async def __aenter__(self) -> FakePrometheus:
        return self

    async def __aexit__(self, *_: Any) -> None:
        return None

    async def heat(self, namespace: str, name: str, window: float) -> None:
        from kvshard_operator.prometheus import PrometheusError

        FakePrometheus.asked["window"] = window
        raise PrometheusError("not queried (probe)")


class FakeJobs:
    created: list[dict[str, Any]] = []

    def read_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return next((j for j in self.created if j["metadata"]["name"] == name), None)

    def create_job(self, namespace: str, body: dict[str, Any]) -> None:
        self.created.append(dict(body))


SPEC: dict[str, Any] = {
    "model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct"}, "catalog": {"builtin": "movielens-100k"},
    "clusters": 3, "podSelector": {"matchLabels": {"app": "engine"}}, "capacityPerPod": "8Gi",
    "etcd": {"endpoints": ["127.0.0.1:2379"]}, "prometheus": {"url": "http://127.0.0.1:9"},
    "rebalance": {"enabled": True, "intervalSeconds": 30},
}


def kopf_group(handlers: Any) -> dict[str, Any]:
    settings = kopf.OperatorSettings()
    handlers.configure(settings=settings, logger=LOG)
    return {"run": SEEN["kopf_run"], "metrics_port": SEEN.get("metrics_port"),
            "finalizer": settings.persistence.finalizer,
            "progress_prefix": settings.persistence.progress_storage.prefix,
            "diffbase_prefix": settings.persistence.diffbase_storage.prefix,
            "standalone": settings.peering.standalone}


async def timers_group(handlers: Any) -> dict[str, Any]:
    from kvshard_operator import rebalancer
    from kvshard_operator.reconcile import ShardState

    registry = kopf.get_default_registry()
    timers = {h.id: [h.interval, h.initial_delay] for h in registry._spawning.get_all_handlers()
              if hasattr(h, "interval")}  # timers; the warm daemon has none
    rebalancer.PrometheusClient = FakePrometheus  # type: ignore[misc,assignment]
    outcome = await rebalancer.rebalance_shard(namespace="probe", name="shard", spec=SPEC, status={},
                                               generation=1, settings=handlers.SETTINGS, state=ShardState(),
                                               logger=LOG)
    return {"timers": timers, "rebalance_outcome": getattr(outcome, "reason", None),
            "promql_window": FakePrometheus.asked.get("window"),
            "prometheus_timeout": FakePrometheus.asked.get("timeout")}


def placement_group(handlers: Any) -> dict[str, Any]:
    from kvshard.catalog_schema import Catalog
    from kvshard_operator import clustering
    from kvshard_operator.catalog_vectors import Loaded
    from kvshard_operator.reconcile import ShardState

    settings = handlers.SETTINGS
    n = 24
    catalog = Catalog(tuple(f"i{i}" for i in range(n)), tuple(f"item number {i}" for i in range(n)))
    vectors = np.random.default_rng(0).standard_normal((n, 8)).astype(np.float16)
    state = ShardState()
    labels = clustering.cluster(Loaded(catalog, vectors), 3, settings, state)
    key = state.labels_key
    assert key is not None
    return {"cluster_key": {"seed": key[3], "slack_percent": key[4], "cooccurrence_percent": key[5],
                            "large": key[6]}, "labelled": len(labels),
            "catalog_change": asyncio.run(catalog_change(settings, catalog, vectors)),
            "bytes": [int(v) for v in clustering.cluster_bytes(catalog, labels, settings.kv_bytes_per_token).values()],
            "bytes_per_1": [int(v) for v in clustering.cluster_bytes(catalog, labels, 1).values()]}


async def catalog_change(settings: Any, old: Any, vectors: Any) -> dict[str, Any]:
    """A catalog change that leaves the clusters at 8, 5 and 5 items (133 % of the mean), through the
    reconciler's ``_labels``: it re-clusters only above ``recluster_imbalance_percent`` (and says so)."""
    from kvshard import placement_schema as ps
    from kvshard.catalog_schema import Catalog
    from kvshard_operator import catalog_update, clustering
    from kvshard_operator.catalog_vectors import Loaded
    from kvshard_operator.reconcile import ShardState

    k = 3
    labels = {item: i // 8 for i, item in enumerate(old.ids)}
    keep = [i for i, item in enumerate(old.ids) if item not in {"i8", "i9", "i10", "i16", "i17", "i18"}]
    new = Catalog(tuple(old.ids[i] for i in keep), tuple(old.texts[i] for i in keep))
    state = ShardState()
    state.catalog = old
    state.centroids = catalog_update.Centroids.from_vectors(np.asarray(vectors, dtype=np.float32),
                                                            list(labels.values()), k)
    state.centroids_key = (old.version, k)
    previous = ps.Placement(1, {c: ("pod-0",) for c in range(k)}, labels, pods=("pod-0",), catalog=old.version)
    said: list[str] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logger = logging.getLogger("operator_run_probe.labels")
    logger.addHandler(Said())
    logger.propagate = False
    _, update = await clustering.catalog_labels(Loaded(new, vectors[keep]), k, previous, None, "probe",  # type: ignore[arg-type]
                                        "shard", settings, state, logger)
    return {"drift_percent": None if update is None else round((update.drift or 0) * 100),
            "reclustered": [m for m in said if "re-clustered" in m]}


async def etcd_group(handlers: Any) -> dict[str, Any]:
    FakeStore.timeouts.clear()
    delays = []
    for retry in (0, 1, 30):
        try:
            await handlers.delete_shard(namespace="probe", name="shard", spec=kopf.Body({"spec": SPEC}).spec,
                                        logger=LOG, retry=retry)
        except kopf.TemporaryError as exc:
            delays.append(exc.delay)
    return {"store_timeouts": sorted(set(FakeStore.timeouts)), "retry_delays": delays}


async def embedding_group(handlers: Any) -> dict[str, Any]:
    from kvshard.catalog_schema import Catalog
    from kvshard_operator import reconcile
    from kvshard_operator.catalog_vectors import Loaded
    from kvshard_operator.reconcile import ShardState

    catalog = Catalog(tuple(f"e{i}" for i in range(18)), tuple(f"embedded item {i}" for i in range(18)))
    outcome = await reconcile._embed(Loaded(catalog), SPEC, "probe", "shard", {}, 1, handlers.SETTINGS, ShardState(),
                                     FakeJobs())
    job = FakeJobs.created[0]
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    return {"retry_after": getattr(outcome, "retry_after", None), "completions": job["spec"]["completions"],
            "parallelism": job["spec"]["parallelism"], "backoff_limit": job["spec"]["backoffLimit"],
            "image": container["image"], "resources": container["resources"],
            "mount": container["volumeMounts"][0]["mountPath"],
            "claim": pod["volumes"][0]["persistentVolumeClaim"]["claimName"]}


def main(flags: list[str]) -> None:
    kopf.run = fake_kopf_run  # type: ignore[assignment]
    prometheus_client.start_http_server = fake_metrics_server  # type: ignore[assignment]
    etcd_store.EtcdStore = FakeStore  # type: ignore[misc,assignment]
    code = cli.main(["operator", "run", *flags])
    from kvshard_operator import handlers

    async def probe() -> dict[str, Any]:
        return {"timers": await timers_group(handlers), "etcd": await etcd_group(handlers),
                "embedding": await embedding_group(handlers)}

    found = {"code": code, "settings": dataclasses.asdict(handlers.SETTINGS), "kopf": kopf_group(handlers),
             "placement": placement_group(handlers), **asyncio.run(probe())}
    print(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1:])
