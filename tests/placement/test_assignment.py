"""Cluster → pods: capacity quotas, replicas on distinct pods, and ≈ 1/N moves on ±1 pod."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshard_operator import placement

GiB = 1 << 30


def pods(n: int, cap: int = 8 * GiB) -> dict[str, int]:
    return {f"pod-{i}": cap for i in range(n)}


def load(assignment: dict[int, list[str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for holders in assignment.values():
        for p in holders:
            out[p] = out.get(p, 0) + 1
    return out


def test_assignment_is_deterministic_and_independent_of_dict_order() -> None:
    a = placement.assign_clusters(range(200), pods(7))
    b = placement.assign_clusters(list(reversed(range(200))), dict(reversed(list(pods(7).items()))))
    assert a == b


def test_equal_pods_get_equal_shares() -> None:
    counts = load(placement.assign_clusters(range(100), pods(10)))
    assert set(counts.values()) == {10}


def test_quotas_follow_capacity() -> None:
    counts = load(placement.assign_clusters(range(90), {"small": GiB, "big": 2 * GiB}))
    assert counts == {"small": 30, "big": 60}


def test_replicas_land_on_distinct_pods() -> None:
    a = placement.assign_clusters(range(50), pods(5), replicas=3)
    assert all(len(set(h)) == 3 for h in a.values())


def test_replicas_are_capped_by_the_number_of_pods() -> None:
    a = placement.assign_clusters(range(5), pods(2), replicas=4)
    assert all(sorted(h) == ["pod-0", "pod-1"] for h in a.values())


def test_no_pods_is_a_placement_error() -> None:
    with pytest.raises(placement.NoPodsError):
        placement.assign_clusters(range(3), {})


def test_clusters_too_big_for_capacity_are_refused() -> None:
    with pytest.raises(placement.InsufficientCapacityError, match="over capacity"):
        placement.assign_clusters(range(4), {"a": 100, "b": 100}, cluster_bytes=dict.fromkeys(range(4), 60))


def test_unchanged_inputs_move_nothing() -> None:
    a = placement.assign_clusters(range(300), pods(9), replicas=2)
    b = placement.assign_clusters(range(300), pods(9), replicas=2, previous=a)
    assert placement.moved_replicas(a, b) == 0


@settings(max_examples=25, deadline=None)
@given(n=st.integers(min_value=2, max_value=40), k_per_pod=st.integers(min_value=5, max_value=30),
       replicas=st.integers(min_value=1, max_value=3))
def test_adding_one_pod_moves_only_what_the_new_pod_takes(n: int, k_per_pod: int, replicas: int) -> None:
    k = n * k_per_pod
    before = placement.assign_clusters(range(k), pods(n), replicas=replicas)
    after = placement.assign_clusters(range(k), pods(n + 1), replicas=replicas, previous=before)
    moved = placement.moved_replicas(before, after)
    ideal = -(-k * replicas // (n + 1))
    new_pod = load(after)["pod-" + str(n)]
    assert new_pod <= ideal
    if replicas == 1:
        assert moved == new_pod
    else:
        # A replica shed by a full pod may belong to a cluster the new pod already holds; it is then
        # swapped over through a third pod, one extra move per such conflict (rare: ≤ 5 %).
        assert new_pod <= moved <= new_pod + max(1, new_pod // 20)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(min_value=3, max_value=40), k_per_pod=st.integers(min_value=5, max_value=30))
def test_removing_one_pod_moves_only_its_clusters(n: int, k_per_pod: int) -> None:
    k = n * k_per_pod
    before = placement.assign_clusters(range(k), pods(n))
    gone = f"pod-{n // 2}"
    remaining = {p: c for p, c in pods(n).items() if p != gone}
    after = placement.assign_clusters(range(k), remaining, previous=before)
    assert placement.moved_replicas(before, after) == load(before)[gone]


def test_one_pod_change_on_a_hundred_pods_is_within_ten_percent_of_ideal() -> None:
    before = placement.assign_clusters(range(1000), pods(100))
    grown = placement.assign_clusters(range(1000), pods(101), previous=before)
    assert placement.moved_replicas(before, grown) / 1000 <= 1.1 / 101


def test_reclustering_inherits_pods_from_the_most_overlapping_old_cluster() -> None:
    old_labels = {"a": 0, "b": 0, "c": 1, "d": 1}
    new_labels = {"a": 1, "b": 1, "c": 0, "d": 0, "e": 2}
    inherited = placement.inherit_assignment(old_labels, new_labels, {0: ["p0"], 1: ["p1"]})
    assert inherited == {1: ["p0"], 0: ["p1"]}


def test_history_plan_replicates_to_every_pod_or_none() -> None:
    plan = placement.history_plan("ReplicateAll", GiB, ["b", "a"])
    assert plan.pods == ("a", "b") and plan.bytes_per_pod == GiB
    assert placement.history_plan("None", GiB, ["a"]).pods == ()


@pytest.mark.parametrize(("text", "value"), [("4Gi", 4 * GiB), ("500M", 500_000_000), ("1024", 1024)])
def test_byte_quantities_parse_like_kubernetes(text: str, value: int) -> None:
    assert placement.parse_bytes(text) == value


def test_a_bad_quantity_is_refused() -> None:
    with pytest.raises(ValueError):
        placement.parse_bytes("4 gigs")
