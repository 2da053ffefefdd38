"""The Warm condition: decided from the current assignment and the pods' warm reports alone."""

from __future__ import annotations

from kvshard import placement_schema as ps
from kvshard_operator import conditions as cond
from kvshard_operator import warmth

PLACEMENT = ps.Placement(3, {0: ("engine-0",), 1: ("engine-0", "engine-1"), 2: ("engine-1",)}, {},
                         pods=("engine-0", "engine-1", "engine-2"))


def report(generation: int, *clusters: int, warming: int = 0) -> ps.WarmReport:
    return ps.WarmReport(generation, clusters, "http://pod", warming)


def test_nothing_placed_is_not_warm() -> None:
    found = warmth.summarize(None, {})
    assert (found.status, found.reason, found.fields()) == ("False", "NotPlaced", {"warmPods": 0, "warmClusters": 0})


def test_a_cluster_is_warm_once_one_of_its_pods_reports_it() -> None:
    found = warmth.summarize(PLACEMENT, {"engine-0": report(3, 0, 1)})
    assert (found.status, found.reason) == ("False", "Warming")
    assert found.fields() == {"warmClusters": 2, "warmPods": 2}  # engine-0 and engine-2 (which holds nothing)
    assert "2/3 clusters warm" in found.message and "engine-0 2/2, engine-1 0/2" in found.message


def test_every_cluster_warm_is_warm_even_while_a_replica_still_warms() -> None:
    found = warmth.summarize(PLACEMENT, {"engine-0": report(3, 0, 1), "engine-1": report(3, 2, warming=1)})
    assert (found.status, found.reason) == ("True", "ClustersWarm")
    assert found.fields() == {"warmClusters": 3, "warmPods": 2}  # engine-1 has not warmed cluster 1 yet


def test_reports_of_another_generation_do_not_count() -> None:
    found = warmth.summarize(PLACEMENT, {"engine-0": report(2, 0, 1), "engine-1": report(4, 1, 2)})
    assert found.fields()["warmClusters"] == 0


def test_apply_writes_only_the_warm_condition_and_counts() -> None:
    ready = cond.set_condition([], cond.READY, cond.TRUE, "Published", "generation 3", at="2026-01-01T00:00:00Z")
    body = {"metadata": {}, "status": {"conditions": ready, "placementGeneration": 3}}
    found = warmth.summarize(PLACEMENT, {"engine-0": report(3, 0, 1), "engine-1": report(3, 1, 2)})
    warmth.apply(body, found, generation=5)
    conditions = body["status"]["conditions"]
    assert cond.get(conditions, cond.READY) == ready[0]
    warm = cond.get(conditions, cond.WARM)
    assert warm is not None and (warm["status"], warm["observedGeneration"]) == ("True", 5)
    assert body["status"]["warmPods"] == 3 and body["status"]["placementGeneration"] == 3
    assert warmth.current(body["status"], found)
    assert not warmth.current(body["status"], warmth.summarize(PLACEMENT, {}))


def test_unknown_warmth_writes_no_counts() -> None:
    found = warmth.Warmth(cond.UNKNOWN, warmth.ETCD_UNAVAILABLE, "etcd down")
    body: dict[str, object] = {}
    warmth.apply(body, found, generation=1)
    assert body["status"] == {"conditions": body["status"]["conditions"]}  # type: ignore[index]


def test_a_new_generation_resets_warm_to_false() -> None:
    outcome = {"conditions": cond.ensure_all([]), "placementGeneration": 4}
    status = warmth.reset(outcome, generation=2, published=4)
    warm = cond.get(status["conditions"], cond.WARM)
    assert warm is not None and (warm["status"], warm["reason"]) == ("False", "Warming")
    assert "generation 4" in warm["message"] and status["placementGeneration"] == 4
    assert (status["warmPods"], status["warmClusters"]) == (0, 0)
