"""The decision's shortcuts give exactly what the plain computation gives: the subset hint's restricted
snapshot is ``with_health`` marking every other pod down, and the recent-blocks credit is the per-pod
sum of the blocks each pod was sent outside its placement."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshard.placement_schema import Placement
from kvshard_router.policies import AffinityPolicy, LoadTable, RouteRequest
from kvshard_router.recent import RecentBlocks
from kvshard_router.snapshot import Snapshot, build_snapshot

PODS = tuple(f"p{j}" for j in range(6))


def snapshot(health: dict[str, bool]) -> Snapshot:
    """Cluster c (items c<c>-k) on pod p<c>; cluster 5 also on p0."""
    items = {f"c{c}-{k}": c for c in range(6) for k in range(4)}
    assignment = {c: (f"p{c}",) for c in range(5)} | {5: ("p5", "p0")}
    warm = {f"p{c}": [c] for c in range(6)} | {"p0": [0, 5]}
    return build_snapshot(Placement(1, assignment, items, pods=PODS), warm, health)


healths = st.dictionaries(st.sampled_from(PODS), st.booleans())
subsets = st.lists(st.sampled_from([*PODS, "not-a-pod"]), max_size=8)


@settings(max_examples=200, deadline=None)
@given(healths, subsets)
def test_restricting_to_a_subset_is_marking_every_other_pod_down(health: dict[str, bool], only: list[str]) -> None:
    snap = snapshot(health)
    before = snap.healthy.tolist()
    restricted = snap.restricted_to(only)
    expected = snap.with_health({p: False for p in snap.pods if p not in set(only)})
    assert restricted.healthy.tolist() == expected.healthy.tolist()
    assert restricted.healthy_indices.tolist() == expected.healthy_indices.tolist()
    assert snap.healthy.tolist() == before  # the snapshot itself is shared: untouched


items = st.sampled_from([f"c{c}-{k}" for c in range(6) for k in range(4)] + ["cold"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(PODS), st.lists(items, min_size=1, max_size=4)), max_size=12),
       st.lists(items, min_size=1, max_size=6), st.lists(st.sampled_from([8, 16, 24]), min_size=6, max_size=6))
def test_the_recent_credit_is_each_pods_sum_over_the_blocks_it_was_sent_outside_its_placement(
    sent: list[tuple[str, list[str]]], asked: list[str], sizes: list[int]
) -> None:
    snap, recent = snapshot({}), RecentBlocks(per_pod=5)
    for pod, blocks in sent:
        recent.record(pod, blocks, snap.clusters_of(blocks), snap)
    tokens = sizes[: len(asked)]
    expected = np.zeros(len(PODS))
    for k, item in enumerate(asked):  # the plain sum: every pod whose list holds the item, off its placement
        holders = set(snap.holders_of(int(snap.clusters_of([item])[0])))
        for j, pod in enumerate(PODS):
            if pod not in holders and item in recent._lists.get(pod, {}):
                expected[j] += tokens[k]
    credit = recent.held_tokens(asked, snap.clusters_of(asked), tokens, snap)
    assert credit.tolist() == expected.tolist()


def test_a_pod_marked_down_is_never_chosen_and_all_up_costs_no_masking() -> None:
    policy, request = AffinityPolicy(), RouteRequest("u", ("c5-0",))
    assert policy.choose(request, snapshot({}), LoadTable()) in {"p0", "p5"}
    assert policy.choose(request, snapshot({"p0": False}), LoadTable()) == "p5"
    assert policy.choose(request, snapshot({}).restricted_to(["p5", "p3"]), LoadTable()) == "p5"
    scores = policy.scores(request, snapshot({"p2": False}), LoadTable())
    assert scores[2] == -np.inf and np.isfinite(np.delete(scores, 2)).all()
