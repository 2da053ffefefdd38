"""Traffic-learned placement: the router's co-request sketch and the operator's colocation swaps."""

from __future__ import annotations

import collections
import random

from kvshard_operator.colocation import colocate, local_share
from kvshard_router.corequest import CoRequestSketch


def scattered(pods: int, per_pod: int, seed: int = 0) -> tuple[dict[int, tuple[str, ...]], list[list[int]]]:
    """``pods × per_pod`` clusters placed round-robin, and a trace whose requests each ask for the
    clusters of one hidden "topic" of ``per_pod`` clusters — topics the placement scattered."""
    clusters = pods * per_pod
    assignment: dict[int, tuple[str, ...]] = {c: (f"pod-{c % pods}",) for c in range(clusters)}
    order = list(range(clusters))
    random.Random(seed).shuffle(order)
    topics = [order[i:i + per_pod] for i in range(0, clusters, per_pod)]
    rng = random.Random(seed + 1)
    trace = [rng.sample(rng.choice(topics), 3) for _ in range(4000)]
    return assignment, trace


def sketch_of(trace: list[list[int]], capacity: int = 4096) -> dict[tuple[int, int], float]:
    sketch = CoRequestSketch(capacity)
    for clusters in trace:
        sketch.add(clusters)
    return dict(sketch.top(1024))


def requests_on_one_pod(assignment: dict[int, tuple[str, ...]], trace: list[list[int]]) -> float:
    return sum(len({assignment[c][0] for c in r}) == 1 for r in trace) / len(trace)


def test_colocation_raises_locality_and_keeps_every_pods_cluster_count() -> None:
    assignment, trace = scattered(pods=8, per_pod=6)
    pairs = sketch_of(trace)
    result = colocate(assignment, pairs, max_moves=200)
    # a greedy swap refinement stops in a local optimum, but far above where it started
    assert result.local_after > 0.7 > 0.2 > result.local_before
    assert requests_on_one_pod(result.assignment, trace) > 4 * requests_on_one_pod(assignment, trace)
    count = collections.Counter(h[0] for h in assignment.values())
    assert collections.Counter(h[0] for h in result.assignment.values()) == count  # capacity kept
    assert set(result.assignment) == set(assignment)


def test_the_movement_budget_bounds_the_clusters_moved() -> None:
    assignment, trace = scattered(pods=8, per_pod=6, seed=3)
    pairs = sketch_of(trace)
    for budget in (0, 1, 2, 6, 11):
        result = colocate(assignment, pairs, max_moves=budget)
        changed = [c for c in assignment if result.assignment[c] != assignment[c]]
        assert len(changed) == len(result.moved) <= budget
        assert result.local_after >= result.local_before
    assert colocate(assignment, pairs, max_moves=6).local_after > local_share(
        {c: h[0] for c, h in assignment.items()}, pairs)


def test_no_traffic_moves_nothing_and_replicas_stay() -> None:
    assignment = {0: ("a", "b"), 1: ("b",), 2: ("a",)}
    assert colocate(assignment, {}, max_moves=10).moved == ()
    result = colocate(assignment, {(1, 2): 5.0}, max_moves=10)
    assert len(result.moved) == 2 and result.assignment[1][0] == result.assignment[2][0]


def test_the_sketch_stays_bounded_and_keeps_the_heavy_pairs() -> None:
    sketch = CoRequestSketch(capacity=64)
    rng = random.Random(0)
    for i in range(5000):
        sketch.add([1, 2] if i % 2 == 0 else rng.sample(range(1000), 4))
        assert len(sketch.counts) <= 64
    assert sketch.top(1)[0][0] == (1, 2)
    sketch.add([7, 7, 8])
    assert sketch.reset() and sketch.counts == {}


def test_swaps_keep_pod_load_under_the_cap_and_relieve_an_overloaded_pod() -> None:
    # two hot clusters on different pods are co-requested: joining them would put both on one pod
    assignment = {0: ("a",), 1: ("b",), 2: ("a",), 3: ("b",)}
    pairs = {(0, 1): 10.0, (2, 3): 0.1}
    rates = {0: 10.0, 1: 10.0, 2: 1.0, 3: 1.0}
    free = colocate(assignment, pairs, max_moves=10)
    assert free.assignment[0][0] == free.assignment[1][0]  # load-blind: the hot pair shares a pod
    capped = colocate(assignment, pairs, rates=rates, max_moves=10, max_load=1.25)
    assert capped.moved == () and capped.load_after == capped.load_before
    # an overloaded pod is relieved first, even at some cost in co-request weight
    skewed = {0: ("a",), 1: ("a",), 2: ("b",), 3: ("b",)}
    relieved = colocate(skewed, {(0, 1): 1.0}, rates=rates, max_moves=2, max_load=1.25)
    assert relieved.load_before > 1.8 and relieved.load_after == 1.0 and relieved.gain < 0


def test_request_weights_follow_the_shares_of_its_candidates() -> None:
    sketch = CoRequestSketch()
    sketch.add([1, 1, 1, 2, -1])  # one unknown item, skipped
    assert sketch.counts == {(1, 2): 0.75 * 0.25}
    assert sketch.rates == {1: 0.75, 2: 0.25}
    interval = sketch.reset()
    assert interval.requests == 1 and sketch.counts == {} and sketch.rates == {}
