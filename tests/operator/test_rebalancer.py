"""The hot-shard rebalancer: one interval at a time against a real etcd and a real Prometheus that
scrapes real exporters, then under kopf with the emulated Kubernetes API."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import etcd3aio
import pytest
from emulated import ETCD_TLS_SECRET, EmulatedCluster, condition, etcd_spec
from kopf.testing import KopfRunner
from polling import wait_until
from traffic import Traffic, running_prometheus, wait_scraped

from kvshard import etcd_keys
from kvshard import placement_schema as ps
from kvshard_local.testing_servers import EtcdServer, PrometheusServer, free_port
from kvshard_operator import placement
from kvshard_operator.prometheus import PrometheusClient
from kvshard_operator.rebalancer import RebalanceOutcome, due, rebalance_shard
from kvshard_operator.reconcile import PodView, ShardState, reconcile
from kvshard_operator.settings import Settings

pytestmark = pytest.mark.slow
NS = "default"
PODS = ("engine-a", "engine-b", "engine-c")
WINDOW = 4.0
SETTINGS = Settings(rebalance_window_seconds=WINDOW, etcd_timeout_seconds=2, prometheus_timeout_seconds=2)
LOG = logging.getLogger("test_rebalancer")
HOT = {0: 60.0, 1: 6.0, 2: 6.0, 3: 6.0, 4: 6.0, 5: 6.0}
"""Cluster 0 takes 60 req/s, the five others 6: the mean is 15, so θ = 200 % makes 0 hot."""


@pytest.fixture(scope="module")
def traffic() -> Iterator[Traffic]:
    t = Traffic(PODS, shards=[f"{NS}/{name}" for name in ("skewed", "interplay", "hot")])
    t.set(clusters=HOT, load={"engine-a": 66.0, "engine-b": 12.0, "engine-c": 12.0},
          tokens={p: (80.0, 100.0) for p in PODS})
    yield t
    t.close()


@pytest.fixture(scope="module")
def prometheus(traffic: Traffic, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    with running_prometheus(traffic.scrape_config(), tmp_path_factory.mktemp("prometheus")) as server:
        wait_scraped(server.url, WINDOW, targets=1 + len(PODS))
        yield server


def tls_secret(etcd: EtcdServer) -> Callable[[str, str], dict[str, bytes]]:
    """A Secret reader that knows one Secret: the test etcd's client certificate."""

    def read(namespace: str, name: str) -> dict[str, bytes]:
        assert (namespace, name) == (NS, ETCD_TLS_SECRET), (namespace, name)
        return etcd.tls_secret_data()

    return read


def spec(etcd: EtcdServer, prometheus_url: str, **rebalance: Any) -> dict[str, Any]:
    return {
        "model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        "catalog": {"file": {"path": "/catalog/items.jsonl"}},
        "clusters": 6,
        "podSelector": {"matchLabels": {"app": "engine"}},
        "capacityPerPod": "8Gi",
        "etcd": etcd_spec(etcd),
        "prometheus": {"url": prometheus_url},
        "rebalance": {"enabled": True, "intervalSeconds": 10, **rebalance},
    }


ONE_EACH = {0: ("engine-a",), 1: ("engine-a",), 2: ("engine-b",), 3: ("engine-b",), 4: ("engine-c",),
            5: ("engine-c",)}


async def seed(etcd: EtcdServer, name: str, assignment: dict[int, tuple[str, ...]] = ONE_EACH) -> ps.Placement:
    """Generation 1 as reconcile would publish it, and every pod warm for what it holds."""
    first = ps.Placement(1, assignment, {f"item-{i}": i % 6 for i in range(30)}, pods=PODS,
                         model="HuggingFaceTB/SmolLM2-135M-Instruct", history_policy="ReplicateAll")
    async with etcd.store() as store:
        await store.publish(NS, name, first, expected=0)
        for pod in PODS:
            await store.put_warm(NS, name, pod, ps.WarmReport(1, tuple(first.clusters_of(pod))))
    return first


async def step(etcd: EtcdServer, name: str, state: ShardState, prometheus_url: str,
               status: dict[str, Any] | None = None, **rebalance: Any) -> RebalanceOutcome:
    outcome = await rebalance_shard(namespace=NS, name=name, spec=spec(etcd, prometheus_url, **rebalance),
                                    status=status or {}, generation=1, settings=SETTINGS, state=state, logger=LOG,
                                    read_secret=tls_secret(etcd))
    assert outcome is not None
    return outcome


async def current(etcd: EtcdServer, name: str) -> ps.Placement:
    async with etcd.store() as store:
        placement = await store.read_current(NS, name)
    assert placement is not None
    return placement


def rebalancing(outcome: RebalanceOutcome) -> dict[str, Any]:
    return condition({"status": outcome.status}, "Rebalancing")


async def test_hot_cluster_is_replicated_within_the_move_budget_until_balanced(
    etcd_server: EtcdServer, prometheus: PrometheusServer, traffic: Traffic
) -> None:
    first = await seed(etcd_server, "skewed")
    state = ShardState()

    # interval 1, one move allowed: cluster 0 gains a replica on the least-loaded pod
    outcome = await step(etcd_server, "skewed", state, prometheus.url, maxMovesPerInterval=1)
    second = await current(etcd_server, "skewed")
    assert outcome.reason == "Rebalanced" and outcome.published == second.generation == 2
    assert [(a.kind, a.cluster, a.pod) for a in outcome.actions] == [("replicate", 0, "engine-b")]
    assert second.assignment == {**first.assignment, 0: ("engine-a", "engine-b")}
    assert second.item_clusters == first.item_clusters and second.history_policy == first.history_policy
    assert (rebalancing(outcome)["status"], rebalancing(outcome)["reason"]) == ("True", "Rebalanced")
    assert "replicated 1, moved 0, dropped 0" in rebalancing(outcome)["message"]
    assert "+0@engine-b" in rebalancing(outcome)["message"]
    assert outcome.status["placementGeneration"] == 2 and outcome.status["lastRebalanceTime"].endswith("Z")

    # the heat snapshot it decided on is stored under heat/, leased for ~10 intervals
    assert outcome.heat_key is not None and outcome.heat_key.startswith(etcd_keys.heat_prefix(NS, "skewed"))
    async with etcd_server.store() as store:
        [(_, heat)] = await store.read_heat(NS, "skewed")
    assert heat["generation"] == 1
    assert heat["cluster_rates"]["0"] == pytest.approx(60, rel=0.3)
    assert heat["pod_load"]["engine-a"] == pytest.approx(66, rel=0.3)
    assert heat["pod_hit_ratio"]["engine-b"] == pytest.approx(0.8, abs=0.05)
    client = etcd3aio.Etcd3Client([etcd_server.endpoint], **etcd_server.client_args())
    await client.connect()
    try:
        assert client.kv is not None and client.lease is not None
        [kv] = (await client.kv.get(outcome.heat_key)).kvs
        assert kv.lease != 0
        assert (await client.lease.time_to_live(kv.lease)).grantedTTL == 100
    finally:
        await client.close()

    # interval 2, same traffic (engine-a still overloaded): one more replica, on the remaining pod
    outcome = await step(etcd_server, "skewed", state, prometheus.url, status=outcome.status, maxMovesPerInterval=1)
    third = await current(etcd_server, "skewed")
    assert outcome.reason == "Rebalanced" and third.generation == 3
    assert [(a.kind, a.cluster, a.pod) for a in outcome.actions] == [("replicate", 0, "engine-c")]
    assert third.assignment[0] == ("engine-a", "engine-b", "engine-c")

    # the router now spreads cluster 0 over three pods; once Prometheus sees it, nothing more to do
    traffic.set(load={"engine-a": 26.0, "engine-b": 32.0, "engine-c": 32.0})
    deadline = time.monotonic() + 20
    async with PrometheusClient(prometheus.url) as client:
        while (await client.heat(NS, "skewed", WINDOW)).pod_load.get("engine-a", 99) > 30:
            assert time.monotonic() < deadline, "Prometheus never saw the balanced load"
            await asyncio.sleep(0.5)
    outcome = await step(etcd_server, "skewed", state, prometheus.url, status=outcome.status, maxMovesPerInterval=1)
    assert (outcome.reason, outcome.published, outcome.actions) == ("Balanced", None, ())
    assert rebalancing(outcome)["status"] == "False" and "lastRebalanceTime" in outcome.status
    assert (await current(etcd_server, "skewed")).generation == 3
    traffic.set(load={"engine-a": 66.0, "engine-b": 12.0, "engine-c": 12.0})


async def test_prometheus_down_publishes_nothing(etcd_server: EtcdServer) -> None:
    await seed(etcd_server, "no-prometheus")
    state = ShardState()
    url = f"http://127.0.0.1:{free_port()}"
    outcome = await step(etcd_server, "no-prometheus", state, url)
    assert outcome.reason == "PrometheusUnavailable" and outcome.published is None
    assert (rebalancing(outcome)["status"], rebalancing(outcome)["reason"]) == ("False", "PrometheusUnavailable")
    assert url in rebalancing(outcome)["message"]
    assert "lastRebalanceTime" not in outcome.status  # no interval was evaluated
    assert state.rebalanced_at is not None  # but the next attempt waits for the next interval
    assert (await current(etcd_server, "no-prometheus")).generation == 1
    async with etcd_server.store() as store:
        assert await store.read_heat(NS, "no-prometheus") == []


async def test_etcd_down_publishes_nothing(tmp_path: Path) -> None:
    with EtcdServer(data_dir=tmp_path / "etcd") as etcd:
        await seed(etcd, "no-etcd")
        etcd.stop()
        outcome = await step(etcd, "no-etcd", ShardState(), f"http://127.0.0.1:{free_port()}")
        assert (outcome.reason, outcome.published) == ("EtcdUnavailable", None)
        assert etcd.endpoint in rebalancing(outcome)["message"]
        etcd.start()
        assert (await current(etcd, "no-etcd")).generation == 1


async def test_no_metrics_yet_is_no_traffic_not_cold_clusters(etcd_server: EtcdServer, tmp_path: Path) -> None:
    await seed(etcd_server, "quiet", {**ONE_EACH, 0: ("engine-a", "engine-b")})  # an extra replica to lose
    with running_prometheus("global:\n  scrape_interval: 1s\nscrape_configs: []\n", tmp_path) as empty:
        outcome = await step(etcd_server, "quiet", ShardState(), empty.url)
    assert (outcome.reason, outcome.published) == ("NoTraffic", None)
    assert rebalancing(outcome)["reason"] == "NoTraffic"
    assert (await current(etcd_server, "quiet")).assignment[0] == ("engine-a", "engine-b")
    async with etcd_server.store() as store:
        [(_, heat)] = await store.read_heat(NS, "quiet")
    assert heat["cluster_rates"] == {} and heat["generation"] == 1


async def test_reconciles_after_pod_changes_keep_the_hot_replicas(
    etcd_server: EtcdServer, prometheus: PrometheusServer, catalog_file: Path
) -> None:
    """A pod joining or leaving must not undo the rebalancer (and make it redo it next interval)."""
    state = ShardState()
    shard = spec(etcd_server, prometheus.url)
    shard["catalog"] = {"file": {"path": str(catalog_file)}}

    async def place(pods: tuple[str, ...], trigger: str) -> int | None:
        views = [PodView(p, {"app": "engine"}, True) for p in pods]
        outcome = await reconcile(namespace=NS, name="interplay", spec=shard, status={}, generation=1, pods=views,
                                  settings=SETTINGS, state=state, trigger=trigger, logger=LOG,
                                  read_secret=tls_secret(etcd_server))
        assert outcome.reason == "Published", outcome.status
        return outcome.published

    assert await place(PODS, "created") == 1
    outcome = await rebalance_shard(namespace=NS, name="interplay", spec=shard, status={}, generation=1,
                                    settings=SETTINGS, state=state, logger=LOG, read_secret=tls_secret(etcd_server))
    assert outcome is not None and outcome.reason == "Rebalanced"
    rebalanced = await current(etcd_server, "interplay")
    hot = rebalanced.assignment[0]
    assert len(hot) >= 2

    assert await place(PODS, "resume") == 2  # same pods: nothing to publish
    assert await place((*PODS, "engine-d"), "pods") == 3  # a pod joins: the hot replicas stay
    assert set(hot) <= set((await current(etcd_server, "interplay")).assignment[0])
    left = hot[-1]
    survivors = tuple(p for p in (*PODS, "engine-d") if p != left)
    assert await place(survivors, "pods") == 4  # a holder leaves: the other hot replicas stay
    after = await current(etcd_server, "interplay")
    assert set(hot) - {left} <= set(after.assignment[0])
    assert await place(survivors, "pods") == 4  # and it is a fixed point

    # a spec edit is a deliberate re-placement: the spec's replica count again
    assert await place(survivors, "spec") == 5
    assert all(len(h) == 1 for h in (await current(etcd_server, "interplay")).assignment.values())


def test_operator_rebalances_a_hot_cacheshard(
    cluster: EmulatedCluster, etcd_server: EtcdServer, prometheus: PrometheusServer, catalog_file: Path
) -> None:
    for pod in PODS:
        cluster.create_pod(pod, {"app": "engine"})
    cluster.trust_etcd(etcd_server)
    body = {"apiVersion": "kvshard.io/v1alpha1", "kind": "CacheShard", "metadata": {"name": "hot"},
            "spec": spec(etcd_server, prometheus.url)}
    body["spec"]["catalog"] = {"file": {"path": str(catalog_file)}}
    started = time.monotonic()
    with KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvshard_operator.handlers"],
                    timeout=60) as runner:
        cluster.create_shard(body)
        rebalanced = wait_until(lambda: condition(cluster.shard("hot"), "Rebalancing").get("reason") == "Rebalanced"
                                and cluster.shard("hot"), timeout=40, what="Rebalancing=True")
        status = rebalanced["status"]
        assert condition(rebalanced, "Rebalancing")["status"] == "True"
        assert "replicated" in condition(rebalanced, "Rebalancing")["message"]
        assert status["placementGeneration"] >= 2 and status["lastRebalanceTime"].endswith("Z")
        placed = asyncio.run(current(etcd_server, "hot"))
        assert placed.generation == status["placementGeneration"]
        assert len(placed.assignment[0]) >= 2  # the hot cluster gained replicas
    assert runner.exception is None, runner.output
    assert "rebalanced: published generation 2" in runner.output
    assert time.monotonic() - started < 60


def test_an_interval_is_due_after_the_last_attempt_or_the_status_time_after_a_restart() -> None:
    state = ShardState()
    assert due(state, {}, 10, now=1000.0)  # never rebalanced
    restarted = {"lastRebalanceTime": "1970-01-01T00:16:35Z"}  # 995 s
    assert not due(state, restarted, 10, now=1000.0) and due(state, restarted, 10, now=1005.0)
    state.rebalanced_at = 1004.0  # memory wins over the status
    assert not due(state, restarted, 10, now=1010.0)
    assert due(state, restarted, 10, now=1013.6, slack_seconds=0.5)


def test_extra_replicas_survive_re_placement_only_on_live_pods_with_room() -> None:
    previous = {0: ["a", "b", "c"], 1: ["b"], 2: ["c", "a"]}
    base = placement.base_replicas(previous, 1)
    assert base == {0: ["a"], 1: ["b"], 2: ["c"]}
    placed = {0: ["a"], 1: ["b"], 2: ["d"]}  # c left; cluster 2's base went to the newcomer
    capacity = {"a": 100, "b": 100, "d": 100}
    kept = placement.keep_extra_replicas(placed, previous, capacity, replicas=1, cluster_bytes={0: 50, 1: 50, 2: 50})
    assert kept == {0: ["a", "b"], 1: ["b"], 2: ["d", "a"]}
    full = placement.keep_extra_replicas(placed, previous, capacity, replicas=1, cluster_bytes={0: 50, 1: 60, 2: 50})
    assert full == {0: ["a"], 1: ["b"], 2: ["d", "a"]}  # b has no room for another 50 bytes
    assert placement.keep_extra_replicas(placed, previous, capacity, replicas=3) == placed  # nothing extra
