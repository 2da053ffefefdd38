"""Sidecars follow placement in etcd: warm exactly their clusters, evict what moves away, report it,
and find peers through placement — against a real etcd and real sidecar processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sidecar_process import Sidecar, SidecarFactory

from kvshard.etcd_store import EtcdStore
from kvshard.placement_schema import Placement, WarmReport
from kvshard.settings import SettingsError, from_sources
from kvshard_local.testing_servers import EtcdServer
from kvshard_sidecar.blockstore.peers import PlacementHolders
from kvshard_sidecar.settings import ENV_PREFIX, SidecarSettings

NAMESPACE, SHARD = "recs", "movielens"
CLUSTER_SIZE = 8  # one batched prefill unit per cluster: keeps the test quick on a busy machine
SMALL_CLUSTERS = 8
ELSEWHERE = 99  # the rest of the catalog, on a pod that never starts here


def cluster_items(cluster: int) -> list[str]:
    return [str(cluster * CLUSTER_SIZE + n) for n in range(1, CLUSTER_SIZE + 1)]


def placement(generation: int, mine: dict[str, tuple[int, ...]]) -> Placement:
    """8 small clusters of MovieLens items plus one big one; ``mine`` maps pod → its small clusters,
    every small cluster nobody named and the big one go to ``pod-z``."""
    items = {item: c for c in range(SMALL_CLUSTERS) for item in cluster_items(c)}
    items.update({str(i): ELSEWHERE for i in range(SMALL_CLUSTERS * CLUSTER_SIZE + 1, 1683)})
    assignment: dict[int, tuple[str, ...]] = {c: tuple(p for p, cs in mine.items() if c in cs) or ("pod-z",)
                                              for c in range(SMALL_CLUSTERS)}
    assignment[ELSEWHERE] = ("pod-z",)
    return Placement(generation, assignment, items, pods=(*mine, "pod-z"))


def etcd_call(server: EtcdServer, action: Callable[[EtcdStore], Any]) -> Any:
    async def run() -> Any:
        async with server.store(timeout=3) as store:
            return await action(store)
    return asyncio.run(run())


def publish(server: EtcdServer, new: Placement) -> None:
    etcd_call(server, lambda s: s.publish(NAMESPACE, SHARD, new, expected=new.generation - 1))


def warm_reports(server: EtcdServer) -> dict[str, WarmReport]:
    result: dict[str, WarmReport] = etcd_call(server, lambda s: s.read_warm(NAMESPACE, SHARD))
    return result


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def metric(sidecar: Sidecar, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(sidecar.metrics()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"{name}{labels} not exported")


def recommend(sidecar: Sidecar, candidates: list[str], history: list[str] | None = None) -> dict[str, Any]:
    status, body = sidecar.json("POST", "/v1/recommend", {"user_id": "7", "history": history or [],
                                                          "candidates": candidates, "max_tokens": 1})
    assert status == 200, body
    result: dict[str, Any] = body["tokens"]
    return result


def follow_flags(server: EtcdServer) -> tuple[str, ...]:
    return ("--etcd-endpoints", server.endpoint, *server.client_flags(), "--cacheshard", f"{NAMESPACE}/{SHARD}")


@pytest.fixture(scope="module")
def pod_a(etcd_server: EtcdServer, start_sidecar: SidecarFactory) -> Iterator[Sidecar]:
    publish(etcd_server, placement(1, {"pod-a": (0, 1)}))
    yield start_sidecar(*follow_flags(etcd_server), name="pod-a")


@pytest.mark.slow
@pytest.mark.model
def test_a_sidecar_warms_its_clusters_reports_them_and_evicts_what_moves_away(
        etcd_server: EtcdServer, pod_a: Sidecar) -> None:
    report = wait_for("pod-a warm for generation 1",
                      lambda: (r := warm_reports(etcd_server).get("pod-a")) and r.clusters == (0, 1) and r)
    assert report == WarmReport(1, (0, 1), pod_a.url, warming=0)
    assert pod_a.json("GET", "/v1/warm")[1] == {
        "pod": "pod-a", "cacheshard": f"{NAMESPACE}/{SHARD}", "url": pod_a.url, "generation": 1,
        "assigned": [0, 1], "warm": [0, 1], "warming": 0, "etcd": "ok", "pending_blocks": 0}
    # exactly the 16 item blocks of clusters 0 and 1, plus the system block they are prefilled behind
    assert metric(pod_a, "kvshard_sidecar_cache_blocks", tier="disk") == 2 * CLUSTER_SIZE + 1
    assert metric(pod_a, "kvshard_sidecar_prefill_blocks_total") == 2 * CLUSTER_SIZE
    assert metric(pod_a, "kvshard_sidecar_assigned_clusters") == 2
    assert metric(pod_a, "kvshard_sidecar_warm_clusters") == 2
    assert metric(pod_a, "kvshard_sidecar_placement_generation") == 1

    tokens = recommend(pod_a, cluster_items(0)[:4] + cluster_items(1)[-3:])
    assert tokens["hit"]["item"] == {"memory": tokens["query"]["item"]}
    assert "item" not in tokens["computed"]
    on_disk = metric(pod_a, "kvshard_sidecar_cache_blocks", tier="disk")  # + the request's label blocks

    publish(etcd_server, placement(2, {"pod-a": (1, 2)}))  # cluster 0 moves away, cluster 2 arrives
    report = wait_for("pod-a warm for generation 2",
                      lambda: (r := warm_reports(etcd_server)["pod-a"]).clusters == (1, 2) and r)
    assert report == WarmReport(2, (1, 2), pod_a.url, warming=0)
    assert metric(pod_a, "kvshard_sidecar_evicted_blocks_total") == CLUSTER_SIZE
    assert metric(pod_a, "kvshard_sidecar_cache_blocks", tier="disk") == on_disk  # 8 dropped, 8 added
    assert metric(pod_a, "kvshard_sidecar_placement_generation") == 2

    arrived = recommend(pod_a, cluster_items(2)[:5])
    assert arrived["hit"]["item"] == {"memory": arrived["query"]["item"]}
    moved = recommend(pod_a, cluster_items(0)[:4])  # evicted from memory and disk: computed again
    assert "item" not in moved["hit"] and moved["computed"]["item"] == moved["query"]["item"]


@pytest.mark.slow
@pytest.mark.model
def test_a_peer_finds_blocks_through_placement_and_survives_an_etcd_outage(
        etcd_server: EtcdServer, pod_a: Sidecar, start_sidecar: SidecarFactory) -> None:
    history = cluster_items(5)[:6]
    recommend(pod_a, cluster_items(3)[:2], history)  # pod-a now holds this history block
    current = etcd_call(etcd_server, lambda s: s.current_generation(NAMESPACE, SHARD))
    publish(etcd_server, placement(current + 1, {"pod-a": (1, 2), "pod-b": (4,)}))
    wait_for("pod-a on the new generation", lambda: warm_reports(etcd_server)["pod-a"].generation == current + 1)
    pod_b = start_sidecar(*follow_flags(etcd_server), name="pod-b")
    wait_for("pod-b warm", lambda: (r := warm_reports(etcd_server).get("pod-b")) and r.clusters == (4,))

    # cluster 2 is warm on pod-a only: pod-b fetches its blocks (and the history block) from pod-a
    tokens = recommend(pod_b, cluster_items(2)[:3], history)
    assert tokens["hit"]["item"] == {"peer": tokens["query"]["item"]}
    assert tokens["hit"]["history"] == {"peer": tokens["query"]["history"]}
    # cluster 6 is on pod-z (never started, no URL): nobody is asked, pod-b computes it
    cold = recommend(pod_b, cluster_items(6)[:2])
    assert cold["computed"]["item"] == cold["query"]["item"]

    etcd_server.stop()
    try:
        local = recommend(pod_b, cluster_items(4)[:3])  # serves from what it stores
        assert local["hit"]["item"] == {"memory": local["query"]["item"]}
    finally:
        etcd_server.start()
    publish(etcd_server, placement(current + 2, {"pod-a": (1, 2), "pod-b": (4, 7)}))
    report = wait_for("pod-b follows after the outage",
                      lambda: (r := warm_reports(etcd_server)["pod-b"]).clusters == (4, 7) and r)
    assert report == WarmReport(current + 2, (4, 7), pod_b.url, warming=0)


def _holders_placement() -> Placement:
    return Placement(3, {0: ("me", "b", "c"), 1: ("b",), 2: ("me",)}, {"i0": 0, "i1": 1, "i2": 2, "i9": 7},
                     pods=("me", "b", "c", "d"))


def test_item_blocks_are_asked_of_warm_holders_first_then_assigned_ones_never_self() -> None:
    holders = PlacementHolders("me", {"k0": "i0", "k1": "i1", "k2": "i2", "k9": "i9"})
    holders.update_placement(_holders_placement())
    holders.update_warm({"me": WarmReport(3, (0, 2), "http://me"), "b": WarmReport(3, (1,), "http://b/"),
                         "c": WarmReport(3, (0,), "http://c"), "d": WarmReport(2, (0,), "http://d")})
    assert holders("k0") == ("http://c", "http://d", "http://b")  # warm c, d (old holder), then assigned b
    assert holders("k1") == ("http://b",)
    assert holders("k2") == ()  # only this pod holds it
    assert holders("k9") == ()  # a cluster placement gives nobody
    assert holders("history-or-system-key") == ("http://b", "http://c", "http://d")


def test_holders_know_nobody_before_placement_and_skip_pods_without_a_url() -> None:
    holders = PlacementHolders("me", {"k0": "i0"})
    assert holders("k0") == () and holders("other") == ()
    holders.update_warm({"b": WarmReport(0, (), "")})
    holders.update_placement(_holders_placement())
    assert holders("k0") == () and holders("other") == ()


@pytest.mark.parametrize(("values", "field"), [
    ({"etcd_endpoints": ("127.0.0.1:2379",)}, "--cacheshard"),
    ({"etcd_endpoints": ("127.0.0.1:2379",), "cacheshard": "movielens"}, "cacheshard"),
    ({"etcd_endpoints": ("127.0.0.1:2379",), "cacheshard": "Recs/Movie_Lens"}, "cacheshard"),
    ({"etcd_endpoints": ("http://127.0.0.1",), "cacheshard": "recs/movielens"}, "etcd_endpoints"),
    ({"advertise_url": "10.0.0.7:8100"}, "advertise_url"),
    ({"warm_history_users": -1}, "warm_history_users"),
    ({"etcd_cert_file": Path("c.crt"), "etcd_key_file": Path("c.key")}, "KVSHARD_SIDECAR_ETCD_CA_FILE.*without the CA"),
    ({"etcd_ca_file": Path("ca.crt"), "etcd_key_file": Path("c.key")}, "come together"),
])
def test_following_settings_are_checked_with_a_message_naming_the_setting(values: dict[str, Any],
                                                                        field: str) -> None:
    with pytest.raises(SettingsError, match=field):
        SidecarSettings(**values)


def test_following_settings_come_from_the_environment_and_default_the_url() -> None:
    environ = {"KVSHARD_SIDECAR_ETCD_ENDPOINTS": "10.0.0.1:2379, 10.0.0.2:2379",
               "KVSHARD_SIDECAR_CACHESHARD": "recs/movielens", "KVSHARD_SIDECAR_ETCD_PASSWORD": "pw"}
    settings = from_sources(SidecarSettings, None, ENV_PREFIX, environ)
    assert settings.etcd_endpoints == ("10.0.0.1:2379", "10.0.0.2:2379")
    assert settings.shard == ("recs", "movielens") and settings.etcd_password == "pw"
    assert settings.url == "http://127.0.0.1:8100"
    assert SidecarSettings(advertise_url="http://10.0.0.7:8100/").url == "http://10.0.0.7:8100"


def test_sidecar_serve_stops_at_an_etcd_ca_file_it_cannot_read(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from kvshard.cli import main

    code = main(["sidecar", "serve", "--etcd-endpoints", "127.0.0.1:2379", "--cacheshard", "recs/movielens",
                 "--etcd-ca-file", str(tmp_path / "missing.crt")])
    assert code == 2
    assert f"cannot read the etcd CA file {tmp_path / 'missing.crt'}" in capsys.readouterr().err
