"""The operator end to end: KopfRunner against the local cluster's Kubernetes API and a real etcd."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulated import EmulatedCluster, condition, etcd_spec
from kopf.testing import KopfRunner
from polling import wait_until

from kvshard import placement_schema as ps
from kvshard_local.testing_servers import EtcdServer
from kvshard_operator import placement

pytestmark = pytest.mark.slow
LABELS = {"app.kubernetes.io/name": "kvshard-engine"}


def shard(name: str, etcd: EtcdServer, catalog: Path, *, clusters: int = 8, **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        "catalog": {"file": {"path": str(catalog)}},
        "clusters": clusters,
        "podSelector": {"matchLabels": LABELS},
        "capacityPerPod": "8Gi",
        "etcd": etcd_spec(etcd),
    }
    spec.update(extra)
    return {"apiVersion": "kvshard.io/v1alpha1", "kind": "CacheShard", "metadata": {"name": name}, "spec": spec}


def etcd_call(etcd: EtcdServer, fn: Any) -> Any:
    async def run() -> Any:
        async with etcd.store(timeout=2, attempts=1) as store:
            return await fn(store)

    return asyncio.run(run())


def current(etcd: EtcdServer, name: str) -> ps.Placement | None:
    result: ps.Placement | None = etcd_call(etcd, lambda s: s.read_current("default", name))
    return result


def generation_is(etcd: EtcdServer, name: str, generation: int) -> ps.Placement | None:
    p = current(etcd, name)
    return p if p is not None and p.generation == generation else None


@contextlib.contextmanager
def operator() -> Iterator[KopfRunner]:
    with KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvshard_operator.handlers"],
                    timeout=60) as runner:
        yield runner
    assert runner.exception is None, runner.output


def items_moved(before: ps.Placement, after: ps.Placement) -> int:
    return sum(set(before.pods_for_item(i)) != set(after.pods_for_item(i)) for i in after.item_clusters)


def test_cacheshard_lifecycle_follows_spec_and_pods(cluster: EmulatedCluster, etcd: EtcdServer,
                                                    catalog_file: Path) -> None:
    cluster.trust_etcd(etcd)
    for i in range(3):
        cluster.create_pod(f"engine-{i}", LABELS)
    cluster.create_pod("unrelated", {"app": "other"})
    with operator():
        cluster.create_shard(shard("items", etcd, catalog_file, clusters=8))
        obj = wait_until(lambda: condition(cluster.shard("items"), "Ready").get("status") == "True"
                         and cluster.shard("items"), what="Ready=True")
        first = wait_until(lambda: generation_is(etcd, "items", 1), what="generation 1 in etcd")
        assert obj["status"]["placementGeneration"] == 1
        assert (obj["status"]["pods"], obj["status"]["clusters"], obj["status"]["itemsPlaced"]) == (3, 8, 40)
        assert set(first.pods) == {"engine-0", "engine-1", "engine-2"}
        assert {c["type"] for c in obj["status"]["conditions"]} >= {"Ready", "Placed", "Degraded", "Rebalancing"}
        assert obj["metadata"]["finalizers"] == ["kvshard.io/etcd-cleanup"]

        # more clusters: a new generation that keeps items where the old clusters were
        cluster.patch_spec("items", {"clusters": 12})
        second = wait_until(lambda: generation_is(etcd, "items", 2), what="generation 2 after clusters change")
        assert second.clusters == 12
        fresh = placement.assign_clusters(sorted(second.assignment), dict.fromkeys(second.pods, 1))
        fresh_placement = ps.Placement(3, {c: tuple(h) for c, h in fresh.items()}, second.item_clusters)
        assert items_moved(first, second) <= items_moved(first, fresh_placement)
        wait_until(lambda: cluster.shard("items")["status"].get("clusters") == 12, what="status.clusters 12")

        # a pod joins: only the newcomer gains clusters
        cluster.create_pod("engine-3", LABELS)
        third = wait_until(lambda: generation_is(etcd, "items", 3), what="generation 3 after a pod joined")
        gained = {(c, p) for c, h in third.assignment.items() for p in h} - {
            (c, p) for c, h in second.assignment.items() for p in h}
        assert gained and {p for _, p in gained} == {"engine-3"}
        assert len(gained) <= 3  # ceil(12 / 4)

        # a pod stops being ready: only its clusters move
        cluster.set_pod_ready("engine-1", False)
        fourth = wait_until(lambda: generation_is(etcd, "items", 4), what="generation 4 after not-ready")
        assert "engine-1" not in fourth.pods
        moved = {c for c in fourth.assignment if fourth.assignment[c] != third.assignment[c]}
        assert moved == set(third.clusters_of("engine-1"))

        # a pod goes away
        cluster.delete_pod("engine-2")
        fifth = wait_until(lambda: generation_is(etcd, "items", 5), what="generation 5 after a pod left")
        assert set(fifth.pods) == {"engine-0", "engine-3"}
        wait_until(lambda: cluster.shard("items")["status"].get("pods") == 2, what="status.pods 2")

        # delete: the finalizer clears etcd, then the object goes
        cluster.delete_shard("items")
        wait_until(lambda: cluster.shard("items") is None, what="CacheShard gone")
        assert etcd_call(etcd, lambda s: s.keys("default", "items")) == []


def test_user_errors_become_conditions_and_other_shards_keep_working(
    cluster: EmulatedCluster, etcd: EtcdServer, catalog_file: Path, tmp_path: Path
) -> None:
    cluster.trust_etcd(etcd)
    cluster.create_pod("engine-0", LABELS)
    with operator():
        cluster.create_shard(shard("missing-catalog", etcd, tmp_path / "nope.jsonl"))
        bad = shard("bad-spec", etcd, catalog_file)
        bad["spec"]["clusters"] = -1
        with pytest.raises(urllib.error.HTTPError) as refused:  # the API refuses it at admission ...
            cluster.create_shard(bad)
        assert refused.value.code == 422 and "spec.clusters" in refused.value.read().decode()
        cluster.store_unchecked_shard(bad)  # ... but one stored before a CRD upgrade meets the operator
        cluster.create_shard(shard("no-pods", etcd, catalog_file, podSelector={"matchLabels": {"app": "ghost"}}))
        cluster.create_shard(shard("good", etcd, catalog_file))
        cluster.create_configmap("catalog", {"items.jsonl": catalog_file.read_text()})
        from_configmap = shard("from-configmap", etcd, catalog_file)
        from_configmap["spec"]["catalog"] = {"configMap": {"name": "catalog", "key": "items.jsonl"}}
        cluster.create_shard(from_configmap)

        for name in ("good", "from-configmap"):
            wait_until(lambda n=name: condition(cluster.shard(n), "Ready").get("status") == "True",
                       what=f"{name} Ready")
        expected = {"missing-catalog": "CatalogNotFound", "bad-spec": "InvalidSpec", "no-pods": "NoPods"}
        for name, reason in expected.items():
            ready = wait_until(lambda n=name: condition(cluster.shard(n), "Ready").get("reason") in expected.values()
                               and condition(cluster.shard(n), "Ready"), what=f"{name} condition")
            assert (ready["status"], ready["reason"]) == ("False", reason)
        assert "spec.clusters" in condition(cluster.shard("bad-spec"), "Ready")["message"]
        assert current(etcd, "bad-spec") is None

        # the shard without pods recovers as soon as a matching pod appears
        cluster.create_pod("ghost-0", {"app": "ghost"})
        wait_until(lambda: condition(cluster.shard("no-pods"), "Ready").get("status") == "True",
                   what="no-pods Ready after a pod appeared")


def test_etcd_outage_degrades_then_recovers_without_half_published_generations(
    cluster: EmulatedCluster, etcd: EtcdServer, catalog_file: Path
) -> None:
    cluster.trust_etcd(etcd)
    cluster.create_pod("engine-0", LABELS)
    with operator():
        cluster.create_shard(shard("items", etcd, catalog_file))
        wait_until(lambda: generation_is(etcd, "items", 1), what="generation 1")
        etcd.stop()
        cluster.create_pod("engine-1", LABELS)
        degraded = wait_until(lambda: condition(cluster.shard("items"), "Degraded").get("status") == "True"
                              and condition(cluster.shard("items"), "Degraded"), what="Degraded=True")
        assert degraded["reason"] == "EtcdUnavailable"
        etcd.start()
        second = wait_until(lambda: generation_is(etcd, "items", 2), timeout=40, what="generation 2 after recovery")
        assert set(second.pods) == {"engine-0", "engine-1"}
        assert len(second.item_clusters) == 40
        wait_until(lambda: condition(cluster.shard("items"), "Degraded").get("status") == "False",
                   what="Degraded=False after recovery")
        keys = etcd_call(etcd, lambda s: s.keys("default", "items"))
        assert not [k for k in keys if "/gen/3/" in k]

        # deleting while etcd is down keeps the finalizer (and the object) until the keys are gone
        etcd.stop()
        cluster.delete_shard("items")
        time.sleep(2)
        assert cluster.shard("items") is not None
        etcd.start()
        wait_until(lambda: cluster.shard("items") is None, timeout=40, what="CacheShard gone after etcd returned")
        assert etcd_call(etcd, lambda s: s.keys("default", "items")) == []


def test_restarted_operator_resumes_without_publishing_again(cluster: EmulatedCluster, etcd: EtcdServer,
                                                             catalog_file: Path) -> None:
    cluster.trust_etcd(etcd)
    cluster.create_pod("engine-0", LABELS)
    with operator():
        cluster.create_shard(shard("items", etcd, catalog_file))
        wait_until(lambda: generation_is(etcd, "items", 1), what="generation 1")
    with operator() as runner:
        wait_until(lambda: condition(cluster.shard("items"), "Ready").get("status") == "True", what="Ready")
        time.sleep(2)  # the resume handler and two pod-sync ticks
    assert "Handler 'resume_shard' succeeded" in runner.output
    assert etcd_call(etcd, lambda s: s.current_generation("default", "items")) == 1


def test_operator_metrics_use_the_component_prefix_and_count_placements(
    cluster: EmulatedCluster, etcd: EtcdServer, catalog_file: Path
) -> None:
    cluster.trust_etcd(etcd)
    from prometheus_client import REGISTRY

    def created() -> float:
        return REGISTRY.get_sample_value("kvshard_operator_rebalances_total", {"reason": "created"}) or 0.0

    before = created()
    cluster.create_pod("engine-0", LABELS)
    with operator():
        cluster.create_shard(shard("counted", etcd, catalog_file, prometheus={"url": "http://prometheus:9090"},
                                   rebalance={"enabled": True, "intervalSeconds": 60}))
        wait_until(lambda: generation_is(etcd, "counted", 1), what="generation 1")
        rebalancing = wait_until(lambda: condition(cluster.shard("counted"), "Rebalancing").get("reason")
                                 == "PrometheusUnavailable" and condition(cluster.shard("counted"), "Rebalancing"),
                                 what="Rebalancing=False for lack of Prometheus")
        assert rebalancing["status"] == "False" and "http://prometheus:9090" in rebalancing["message"]
    assert created() == before + 1
    assert (REGISTRY.get_sample_value("kvshard_operator_placement_seconds_count") or 0) >= 1
    # the shard named as on the router's and the sidecars' series, so dashboards join on it
    assert REGISTRY.get_sample_value("kvshard_operator_placement_generation", {"cacheshard": "default/counted"}) == 1
    from prometheus_client.metrics import MetricWrapperBase

    from kvshard_operator import metrics

    collectors = [v for v in vars(metrics).values() if isinstance(v, MetricWrapperBase)]
    names = {m.name for c in collectors for m in c.collect()}
    assert len(names) >= 5 and all(n.startswith("kvshard_operator_") for n in names)


def report_warm(etcd: EtcdServer, pod: str, placement_: ps.Placement, clusters: list[int] | None = None) -> None:
    """What a sidecar does: report the clusters it has warmed for a generation."""
    warmed = placement_.clusters_of(pod) if clusters is None else clusters
    report = ps.WarmReport(placement_.generation, tuple(warmed), f"http://{pod}:8100",
                           len(placement_.clusters_of(pod)) - len(warmed))
    etcd_call(etcd, lambda s: s.put_warm("default", "items", pod, report))


def test_warm_condition_follows_the_pods_warm_reports(cluster: EmulatedCluster, etcd: EtcdServer,
                                                      catalog_file: Path) -> None:
    cluster.trust_etcd(etcd)
    for i in range(2):
        cluster.create_pod(f"engine-{i}", LABELS)
    with operator():
        cluster.create_shard(shard("items", etcd, catalog_file, clusters=4))
        first = wait_until(lambda: generation_is(etcd, "items", 1), what="generation 1")
        cold = wait_until(lambda: condition(cluster.shard("items"), "Warm").get("reason") == "Warming"
                          and cluster.shard("items"), what="Warm=False (Warming) before any report")
        assert condition(cold, "Warm")["status"] == "False" and condition(cold, "Ready")["status"] == "True"

        # engine-0 warmed its clusters: those are served from cache, engine-1's are not yet
        report_warm(etcd, "engine-0", first)
        mine = len(first.clusters_of("engine-0"))
        half = wait_until(lambda: cluster.shard("items")["status"].get("warmClusters") == mine
                          and cluster.shard("items"), what=f"warmClusters {mine}")
        assert (half["status"]["warmPods"], condition(half, "Warm")["status"]) == (1, "False")
        assert f"engine-0 {mine}/{mine}" in condition(half, "Warm")["message"]

        # a stale report (another generation) does not count; a current one does
        report_warm(etcd, "engine-1", ps.Placement(7, first.assignment, {}))
        time.sleep(1.5)
        assert cluster.shard("items")["status"]["warmPods"] == 1
        report_warm(etcd, "engine-1", first)
        warm = wait_until(lambda: condition(cluster.shard("items"), "Warm").get("status") == "True"
                          and cluster.shard("items"), what="Warm=True")
        assert condition(warm, "Warm")["reason"] == "ClustersWarm"
        assert (warm["status"]["warmPods"], warm["status"]["warmClusters"]) == (2, 4)
        assert condition(warm, "Ready")["reason"] == "Published"  # the warm timer wrote only its own fields
        assert [c["type"] for c in warm["status"]["conditions"]].count("Warm") == 1

        # a pod joins: a new generation is cold until its pods report on it
        cluster.create_pod("engine-2", LABELS)
        wait_until(lambda: generation_is(etcd, "items", 2), what="generation 2")
        again = wait_until(lambda: condition(cluster.shard("items"), "Warm").get("status") == "False"
                           and cluster.shard("items"), what="Warm=False for generation 2")
        assert "generation 2" in condition(again, "Warm")["message"]
