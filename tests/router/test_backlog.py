"""The router's backlog: work in token equivalents, drained at a rate learned from answers, and the
affinity choice it drives (the request goes where it would be done first)."""

from __future__ import annotations

import pytest

from kvshard.placement_schema import Placement
from kvshard_router.backlog import Backlog
from kvshard_router.policies import AffinityPolicy, LoadTable, RouteRequest
from kvshard_router.snapshot import Snapshot, build_snapshot


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


PODS = ("p0", "p1")


def snapshot() -> Snapshot:
    """Cluster 0 (items a-*) on p0, cluster 1 (items b-*) on p1."""
    items = {f"{name}-{k}": c for c, name in enumerate("ab") for k in range(5)}
    return build_snapshot(Placement(1, {0: ("p0",), 1: ("p1",)}, items, pods=PODS), {"p0": [0], "p1": [1]})


def test_a_request_costs_its_overhead_its_uncached_tokens_and_a_share_of_its_cached_ones() -> None:
    backlog = Backlog(cached_cost=0.25, overhead_tokens=100)
    assert backlog.work(cached_tokens=40, total_tokens=100) == 100 + 60 + 10


def test_the_backlog_drains_at_the_rate_the_pod_showed_and_empties_with_its_last_answer() -> None:
    clock = Clock()
    backlog = Backlog(overhead_tokens=0, clock=clock)
    snap = snapshot()
    backlog.start("p0", 100.0)
    clock.now = 2.0
    assert backlog.outstanding(snap).tolist() == [100.0, 0.0]  # no answer seen yet: nothing drains
    backlog.finish("p0", 100.0)
    assert backlog.rate("p0") == 50.0 and backlog.rate("p1") is None
    assert backlog.outstanding(snap).tolist() == [0.0, 0.0]

    backlog.start("p0", 100.0)
    backlog.start("p0", 100.0)
    clock.now = 3.0
    assert backlog.outstanding(snap)[0] == pytest.approx(150.0)
    clock.now = 10.0
    assert backlog.outstanding(snap)[0] == 0.0  # never below zero while the answers are late
    backlog.finish("p0", 100.0)
    assert backlog.inflight(snap).tolist() == [1.0, 0.0]
    backlog.finish("p0", 100.0)
    assert backlog.outstanding(snap).tolist() == [0.0, 0.0]
    assert backlog.inflight(snap).tolist() == [0.0, 0.0]


def test_a_pod_slower_than_estimated_gets_a_lower_rate() -> None:
    clock = Clock()
    backlog = Backlog(overhead_tokens=0, smoothing=1.0, clock=clock)
    backlog.start("p0", 100.0)
    clock.now = 1.0
    backlog.finish("p0", 100.0)
    backlog.start("p0", 100.0)
    clock.now = 5.0
    backlog.finish("p0", 100.0)
    assert backlog.rate("p0") == 25.0


def test_affinity_waits_for_the_holder_when_its_backlog_is_shorter_than_the_prefill_saved() -> None:
    clock = Clock()
    backlog = Backlog(cached_cost=0.2, overhead_tokens=0, clock=clock)
    request = RouteRequest("u", ("a-0", "a-1"), item_tokens=(100, 100))  # all on p0: 160 tokens saved there
    backlog.start("p0", 100.0)
    clock.now = 1.0
    backlog.finish("p0", 100.0)  # p0 drains 100 token equivalents per second
    policy, snap = AffinityPolicy(), snapshot()

    backlog.start("p0", 100.0)  # 100 left, less than the 160 saved: still p0
    assert policy.choose(request, snap, backlog) == "p0"
    backlog.start("p0", 100.0)  # 200 left: p1 is done first
    assert policy.choose(request, snap, backlog) == "p1"
    clock.now = 1.5  # 150 left: p0 again
    assert policy.choose(request, snap, backlog) == "p0"
    # counting requests instead (λ = one 250-token request each), progress is invisible: p1 throughout
    counts = LoadTable()
    counts.start("p0")
    assert AffinityPolicy(load_penalty_tokens=250).choose(request, snap, counts) == "p1"


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="cached_cost"):
        Backlog(cached_cost=1.5)
    with pytest.raises(ValueError, match="smoothing"):
        Backlog(smoothing=0.0)
