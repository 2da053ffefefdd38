"""Routing policies: health, ties, affinity scoring, fairness and prefix memory, as specs."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshard.placement_schema import Placement
from kvshard_router.policies import (
    POLICIES,
    AffinityPolicy,
    LoadTable,
    PrefixAwarePolicy,
    RouteRequest,
    UnknownPolicyError,
    make_policy,
)
from kvshard_router.snapshot import Snapshot, build_snapshot

PODS = ("p0", "p1", "p2", "p3")


def snapshot(health: dict[str, bool] | None = None) -> Snapshot:
    """Cluster c lives on p<c>; items i<c>-<k> belong to cluster c; cluster 4 is replicated on p1, p2."""
    assignment = {0: ("p0",), 1: ("p1",), 2: ("p2",), 3: ("p3",), 4: ("p1", "p2")}
    items = {f"i{c}-{k}": c for c in assignment for k in range(10)}
    warm = {"p0": [0], "p1": [1, 4], "p2": [2, 4], "p3": [3]}
    return build_snapshot(Placement(1, assignment, items, pods=PODS), warm, health or {})


def loads(**values: float) -> LoadTable:
    table = LoadTable()
    for pod, value in values.items():
        table.set(pod, value)
    return table


REQUEST = RouteRequest("u", ("i2-0", "i2-1", "i0-0"), item_tokens=(10, 10, 10))


def test_registry_builds_every_policy_by_name_and_rejects_unknown_names() -> None:
    assert set(POLICIES) >= {"round-robin", "least-loaded", "prefix-aware", "affinity"}
    with pytest.raises(UnknownPolicyError, match="known: affinity"):
        make_policy("random")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_unhealthy_pods_are_never_chosen(name: str) -> None:
    policy = make_policy(name)
    snap = snapshot({"p2": False, "p0": False})
    table = loads(p1=5, p3=5)
    chosen = {policy.choose(REQUEST, snap, table) for _ in range(20)}
    assert chosen <= {"p1", "p3"}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_healthy_pod_means_no_choice(name: str) -> None:
    assert make_policy(name).choose(REQUEST, snapshot(dict.fromkeys(PODS, False)), LoadTable()) is None


def test_affinity_picks_the_pod_holding_most_request_tokens() -> None:
    assert AffinityPolicy().choose(REQUEST, snapshot(), LoadTable()) == "p2"


def test_affinity_weighs_tokens_not_item_counts() -> None:
    request = RouteRequest("u", ("i2-0", "i2-1", "i0-0"), item_tokens=(5, 5, 40))
    assert AffinityPolicy().choose(request, snapshot(), LoadTable()) == "p0"


def test_affinity_shares_equal_replicas_in_turn() -> None:
    request = RouteRequest("u", ("i4-0",))
    policy = AffinityPolicy()
    counts = collections.Counter(policy.choose(request, snapshot(), LoadTable()) for _ in range(10))
    assert counts == {"p1": 5, "p2": 5}


def test_affinity_ties_go_to_the_least_loaded_holder() -> None:
    request = RouteRequest("u", ("i4-0", "i4-1"))
    policy = AffinityPolicy(load_penalty_tokens=0)  # scores tie exactly: load only breaks the tie
    assert policy.choose(request, snapshot(), loads(p1=2, p2=1)) == "p2"
    assert policy.choose(request, snapshot(), loads(p1=1, p2=2)) == "p1"


def test_affinity_spills_to_another_pod_when_the_holder_is_overloaded() -> None:
    policy = AffinityPolicy(load_penalty_tokens=5)
    assert policy.choose(REQUEST, snapshot(), loads(p2=1)) == "p2"  # 20 − 5 > 10 (p0)
    assert policy.choose(REQUEST, snapshot(), loads(p2=3)) == "p0"  # 20 − 15 < 10


def test_affinity_counts_history_on_every_pod() -> None:
    request = RouteRequest("u", ("i3-0",), history=("x",), history_tokens=500, item_tokens=(10,))
    scores = AffinityPolicy().scores(request, snapshot(), LoadTable())
    assert scores.tolist() == [500.0, 500.0, 500.0, 510.0]


def test_affinity_ignores_items_outside_the_placement() -> None:
    request = RouteRequest("u", ("cold-start-item",))
    assert AffinityPolicy().choose(request, snapshot(), loads(p0=3, p1=1, p2=2, p3=4)) == "p1"


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.sampled_from([f"i{c}-{k}" for c in range(5) for k in range(3)] + ["cold"]), max_size=8),
    st.lists(st.integers(0, 4), min_size=4, max_size=4),
    st.lists(st.booleans(), min_size=4, max_size=4),
    st.sampled_from([0.0, 3.0, 10.0]),
)
def test_affinity_choice_is_the_argmax_of_its_scores_with_least_loaded_ties(
    items: list[str], load_values: list[int], health: list[bool], lam: float
) -> None:
    snap = snapshot(dict(zip(PODS, health, strict=True)))
    table = loads(**{p: float(v) for p, v in zip(PODS, load_values, strict=True)})
    policy = AffinityPolicy(load_penalty_tokens=lam)
    request = RouteRequest("u", tuple(items))
    chosen = policy.choose(request, snap, table)
    if not any(health):
        assert chosen is None
        return
    scores = policy.scores(request, snap, table)
    best = [j for j in range(4) if scores[j] == scores.max()]
    least = min(load_values[j] for j in best)
    assert chosen in {PODS[j] for j in best if load_values[j] == least}


def test_round_robin_is_fair_over_healthy_pods() -> None:
    policy = make_policy("round-robin")
    snap = snapshot({"p3": False})
    counts = collections.Counter(policy.choose(REQUEST, snap, loads(p0=9)) for _ in range(300))
    assert counts == {"p0": 100, "p1": 100, "p2": 100}


def test_least_loaded_picks_the_idlest_pod_and_rotates_among_equals() -> None:
    policy = make_policy("least-loaded")
    assert policy.choose(REQUEST, snapshot(), loads(p0=3, p1=1, p2=2, p3=4)) == "p1"
    chosen = {policy.choose(REQUEST, snapshot(), loads(p0=1, p1=1)) for _ in range(4)}
    assert chosen == {"p2", "p3"}


def test_prefix_aware_sends_a_users_next_request_where_its_prefix_was_served() -> None:
    policy = PrefixAwarePolicy()
    snap, table = snapshot(), LoadTable()
    first = policy.choose(RouteRequest("alice", ("i0-0", "i1-0"), history=("h1",)), snap, table)
    assert first is not None
    table.set(first, 3)  # busier than the others, yet the prefix match wins
    again = policy.choose(RouteRequest("alice", ("i3-0",), history=("h1",)), snap, table)
    assert again == first
    other = policy.choose(RouteRequest("bob", ("i0-0", "i1-0"), history=("h1",)), snap, table)
    assert other != first


def test_prefix_aware_prefers_the_longest_match_over_a_less_loaded_shorter_one() -> None:
    policy = PrefixAwarePolicy()
    table = LoadTable()
    assert policy.choose(RouteRequest("v", ("x", "y")), snapshot(), table) == "p0"
    # p0 down for a moment: the same user (a shorter, history-only match) lands on p1.
    assert policy.choose(RouteRequest("v", ("z",)), snapshot({"p0": False}), table) == "p1"
    table.set("p0", 5)
    assert policy.choose(RouteRequest("v", ("x", "y", "w")), snapshot(), table) == "p0"
    assert policy.choose(RouteRequest("v", ("q",)), snapshot(), table) == "p1"


def test_prefix_aware_falls_back_when_the_matching_pod_is_unhealthy() -> None:
    policy = PrefixAwarePolicy()
    request = RouteRequest("alice", ("i0-0",))
    first = policy.choose(request, snapshot(), LoadTable())
    assert first is not None
    assert policy.choose(request, snapshot({first: False}), LoadTable()) != first


def test_prefix_aware_memory_is_bounded() -> None:
    policy = PrefixAwarePolicy(capacity=50)
    snap, table = snapshot(), LoadTable()
    for u in range(200):
        policy.choose(RouteRequest(f"user{u}", tuple(f"i{u % 4}-{k}" for k in range(5))), snap, table)
    assert len(policy) == 50


def test_load_table_follows_pod_order_across_snapshots() -> None:
    table = loads(p2=4)
    table.start("p0")
    assert table.inflight(snapshot()).tolist() == [1, 0, 4, 0]
    table.finish("p2")
    assert np.array_equal(table.inflight(snapshot()), [1, 0, 3, 0])
