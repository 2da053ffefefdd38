"""The blocks the router sent each pod outside its placement: counted as cached there, bounded per pod,
never counted twice, and what the affinity policy does with them."""

from __future__ import annotations

import numpy as np
import pytest

from kvshard.placement_schema import Placement
from kvshard_router.policies import AffinityPolicy, LoadTable, RouteRequest
from kvshard_router.recent import RecentBlocks
from kvshard_router.snapshot import Snapshot, build_snapshot

PODS = ("p0", "p1", "p2")


def snapshot() -> Snapshot:
    """Cluster c (items c<c>-k) on pod p<c>."""
    items = {f"c{c}-{k}": c for c in range(3) for k in range(10)}
    assignment = {c: (f"p{c}",) for c in range(3)}
    return build_snapshot(Placement(1, assignment, items, pods=PODS), {f"p{c}": [c] for c in range(3)})


def held(recent: RecentBlocks, snap: Snapshot, items: tuple[str, ...], tokens: int = 10) -> list[float]:
    return recent.held_tokens(items, snap.clusters_of(items), tokens, snap).tolist()


def test_blocks_sent_outside_the_placement_count_on_that_pod_only() -> None:
    snap, recent = snapshot(), RecentBlocks(per_pod=8)
    sent = ("c1-0", "c1-1", "c0-0")  # c0-0 is p0's by placement: not recorded
    recent.record("p0", sent, snap.clusters_of(sent), snap)
    assert len(recent) == 2
    assert held(recent, snap, ("c1-0", "c1-1", "c0-0", "c2-0")) == [20.0, 0.0, 0.0]


def test_each_pod_keeps_only_its_newest_blocks() -> None:
    snap, recent = snapshot(), RecentBlocks(per_pod=2)
    for item in ("c1-0", "c1-1", "c1-0", "c1-2"):  # c1-0 is used again before c1-2 arrives
        recent.record("p0", (item,), snap.clusters_of((item,)), snap)
    assert held(recent, snap, ("c1-0",)) == [10.0, 0.0, 0.0]
    assert held(recent, snap, ("c1-1",)) == [0.0, 0.0, 0.0]  # the least recently sent went first
    recent.forget("p0")
    assert len(recent) == 0 and held(recent, snap, ("c1-0", "c1-2")) == [0.0, 0.0, 0.0]


def test_a_pod_that_leaves_the_placement_is_forgotten() -> None:
    snap, recent = snapshot(), RecentBlocks(per_pod=8)
    recent.record("p2", ("c1-0",), snap.clusters_of(("c1-0",)), snap)
    items = {f"c{c}-{k}": c for c in range(2) for k in range(10)}
    smaller = build_snapshot(Placement(2, {0: ("p0",), 1: ("p1",)}, items, pods=("p0", "p1")),
                             {"p0": [0], "p1": [1]})
    assert held(recent, smaller, ("c1-0",)) == [0.0, 0.0]
    assert len(recent) == 0


def test_blocks_of_a_cluster_placed_on_the_pod_are_not_counted_after_it_moves_away() -> None:
    """A sidecar evicts every block of a cluster that moves off it, the copies it computed before it
    held the cluster included; so an entry must not outlive the pod's holding of its cluster."""
    snap, recent = snapshot(), RecentBlocks(per_pod=8)
    sent = ("c1-0", "c1-1", "c2-0")
    recent.record("p0", sent, snap.clusters_of(sent), snap)
    items = {f"c{c}-{k}": c for c in range(3) for k in range(10)}
    given = build_snapshot(Placement(2, {0: ("p0",), 1: ("p0", "p1"), 2: ("p2",)}, items, pods=PODS),
                           {"p0": [0, 1], "p1": [1], "p2": [2]})  # p0 is given c1 (e.g. a scale-in)
    assert held(recent, given, sent) == [10.0, 0.0, 0.0]  # c1 counts once, by placement; c2-0 from the list
    taken = build_snapshot(Placement(3, {0: ("p0",), 1: ("p1",), 2: ("p2",)}, items, pods=PODS),
                           {"p0": [0], "p1": [1], "p2": [2]})  # c1 moves off p0 again: p0 evicted it
    assert held(recent, taken, sent) == [10.0, 0.0, 0.0]  # only c2-0, which p0 never held by placement
    assert len(recent) == 1
    healthy_only = taken.with_health({"p1": False})  # a health change is not a new placement
    assert held(recent, healthy_only, sent) == [10.0, 0.0, 0.0]


def test_the_affinity_policy_sends_blocks_back_to_the_pod_that_computed_them() -> None:
    snap = snapshot()
    first = RouteRequest("u", ("c0-0", "c0-1", "c0-2", "c1-5", "c1-6"))  # p0 holds 3, p1 2: p0 computes c1-5, c1-6
    later = RouteRequest("v", ("c1-5", "c1-6", "c0-3", "c0-4"))  # by placement p0 and p1 hold two each
    busy = LoadTable()
    busy.set("p0", 1.0)  # and p0 has a request in flight
    remembering = AffinityPolicy(load_penalty_tokens=5, recent_blocks_per_pod=64)
    forgetful = AffinityPolicy(load_penalty_tokens=5)
    assert remembering.choose(first, snap, LoadTable()) == forgetful.choose(first, snap, LoadTable()) == "p0"
    assert remembering.choose(later, snap, busy) == "p1"  # nothing answered yet: nothing remembered
    remembering.served("p0", first, snap)
    forgetful.served("p0", first, snap)
    assert remembering.choose(later, snap, busy) == "p0"  # 4 blocks × 16 tokens − 5 beats p1's 32
    assert forgetful.choose(later, snap, busy) == "p1"  # 32 − 5 loses to p1's 32
    assert forgetful.recent is None


def test_per_pod_must_be_positive() -> None:
    with pytest.raises(ValueError, match="per_pod"):
        RecentBlocks(0)
    assert np.array_equal(RecentBlocks(1).held_tokens((), np.zeros(0, dtype=np.int64), 1, snapshot()), np.zeros(3))
