"""The compiled decision gives bit for bit what its numpy specification gives.

The router's decision runs as compiled loops (:mod:`kvshard_router.kernels`). Their specification is the
numpy code they replaced, written out here: cached tokens summed in item order, the recent credit, the
backlog's cost or λ × in-flight, −inf for unhealthy pods, the highest score within 1e-9, ties to the least
loaded and then in turn. The fast decision (:func:`kernels.choose`) prices only the pods a request can
tell apart; it must choose exactly as the dense one over every pod, whatever the placement, health,
backlogs, recent blocks and ties.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshard.placement_schema import Placement
from kvshard_router import kernels
from kvshard_router.backlog import Backlog
from kvshard_router.policies import LoadTable
from kvshard_router.snapshot import build_snapshot


def dense_scores(held: np.ndarray, recent: np.ndarray | None, healthy: np.ndarray, inflight: np.ndarray,
                 penalty: float, pricing: tuple[np.ndarray, np.ndarray, np.ndarray, float, float, float] | None,
                 ) -> np.ndarray:
    """The affinity score in numpy, as the router computed it before it was compiled."""
    score = held if recent is None else held + recent
    if pricing is not None:
        backlog, rate, at, now, fixed, saving = pricing
        score = -(np.maximum(0.0, backlog - rate * (now - at)) + (fixed - saving * score))
    else:
        score = score - penalty * inflight
    score = score.copy()
    score[~healthy] = -np.inf
    return score


def dense_best(score: np.ndarray, inflight: np.ndarray, turn: int) -> tuple[int, int]:
    if not np.isfinite(score).any() and score.max() == -np.inf:
        return -1, turn
    best = float(score.max())
    tied = np.flatnonzero(score >= best - 1e-9 * max(1.0, abs(best)))
    if len(tied) > 1:
        loads = inflight[tied]
        tied = tied[loads == loads.min()]
        turn += 1
    return int(tied[turn % len(tied)]), turn


@st.composite
def decisions(draw: st.DrawFn) -> dict[str, object]:
    """A random decision's inputs: placement (CSR holders), a request, health, load and recent blocks."""
    pods = draw(st.integers(1, 10))
    clusters = draw(st.integers(1, 6))
    rows = [draw(st.lists(st.integers(0, pods - 1), max_size=3, unique=True)) for _ in range(clusters)]
    indptr = np.zeros(clusters + 1, dtype=np.int32)
    np.cumsum([len(r) for r in rows], out=indptr[1:])
    holders = np.array([p for r in rows for p in r], dtype=np.int32)
    items = draw(st.integers(0, 8))
    item_clusters = np.array(draw(st.lists(st.integers(-1, clusters), min_size=items, max_size=items)),
                             dtype=np.int64)  # −1 unknown, ``clusters`` out of range
    per_item = draw(st.booleans())
    tokens = np.array(draw(st.lists(st.sampled_from([8.0, 16.0, 24.0, 0.5]), min_size=items if per_item else 1,
                                    max_size=items if per_item else 1)) or [16.0])
    if per_item and items == 0:
        tokens = np.array([16.0])
    sent = draw(st.lists(st.tuples(st.integers(0, max(0, items - 1)), st.integers(0, pods - 1)), max_size=6,
                         unique=True)) if items else []
    healthy = np.array(draw(st.lists(st.booleans(), min_size=pods, max_size=pods)), dtype=np.bool_)
    active = sorted(draw(st.sets(st.integers(0, pods - 1))))
    inflight = np.zeros(pods)
    backlog, rate, at = np.zeros(pods), np.array(draw(st.lists(st.sampled_from([0.0, 0.5, 2.0]), min_size=pods,
                                                               max_size=pods))), np.zeros(pods)
    now = 10.0
    for p in range(pods):
        at[p] = draw(st.sampled_from([0.0, 5.0, 10.0]))
        if p in active:
            inflight[p] = draw(st.sampled_from([0.0, 1.0, 2.0]))
            backlog[p] = draw(st.sampled_from([0.0, 4.0, 40.0, 300.0]))
    priced = draw(st.booleans())
    return {
        "clusters": item_clusters, "tokens": tokens, "indptr": indptr, "holders": holders,
        "base": draw(st.sampled_from([0.0, 300.0])),
        "sent_items": np.array([k for k, _ in sent], dtype=np.int64),
        "sent_pods": np.array([j for _, j in sent], dtype=np.int64),
        "healthy": healthy, "active": np.array(active, dtype=np.int64), "inflight": inflight,
        "penalty": draw(st.sampled_from([0.0, 8.0, 32.0])),
        "pricing": (backlog, rate, at, now, draw(st.sampled_from([428.0, 0.0])), 0.8) if priced else None,
        "turn": draw(st.integers(0, 5)),
    }


@settings(max_examples=400, deadline=None)
@given(decisions())
def test_the_sparse_choice_is_the_dense_choice_over_every_pod(d: dict) -> None:  # type: ignore[type-arg]
    pods = len(d["healthy"])
    held = kernels.held_tokens(d["clusters"], d["tokens"], d["indptr"], d["holders"], pods, d["base"])
    recent = (kernels.recent_credit(d["clusters"], d["tokens"], d["indptr"], d["holders"], pods, d["sent_items"],
                                    d["sent_pods"]) if len(d["sent_items"]) else None)
    score = dense_scores(held, recent, d["healthy"], d["inflight"], d["penalty"], d["pricing"])
    expected, expected_turn = dense_best(score, d["inflight"], d["turn"])

    pricing = d["pricing"] or (kernels.NOTHING, kernels.NOTHING, kernels.NOTHING, 0.0, 0.0, 0.0)
    scratch = np.full(pods, -1, dtype=np.int32)
    chosen, turn, cached = kernels.choose(
        d["clusters"], d["tokens"], d["indptr"], d["holders"], d["base"], d["sent_items"], d["sent_pods"],
        d["healthy"], int(d["healthy"].sum()), d["active"], d["inflight"], d["penalty"], *pricing, scratch, d["turn"])
    assert (chosen, turn) == (expected, expected_turn)
    assert cached == (held[chosen] if chosen >= 0 else 0.0)
    assert (scratch == -1).all()  # the slot map is handed back clean

    compiled = kernels.affinity_scores(held, kernels.NOTHING if recent is None else recent, d["healthy"],
                                       d["inflight"], d["penalty"], *pricing)
    assert compiled.tobytes() == score.tobytes()  # the dense kernel is the numpy formula, bit for bit
    assert kernels.best(score, d["inflight"], d["turn"]) == (expected, expected_turn)


def test_held_tokens_sum_each_holders_items_in_item_order() -> None:
    indptr, holders = np.array([0, 2, 3], dtype=np.int32), np.array([0, 2, 1], dtype=np.int32)
    held = kernels.held_tokens(np.array([0, 1, -1, 0, 5]), np.array([1.0, 2.0, 4.0, 8.0, 16.0]), indptr, holders,
                               3, 100.0)
    assert held.tolist() == [109.0, 102.0, 109.0]


def test_a_recent_block_counts_only_on_pods_that_do_not_hold_its_cluster() -> None:
    indptr, holders = np.array([0, 1], dtype=np.int32), np.array([0], dtype=np.int32)
    credit = kernels.recent_credit(np.array([0, -1]), np.array([5.0, 7.0]), indptr, holders, 3,
                                   np.array([0, 0, 1]), np.array([0, 2, 2]))
    assert credit.tolist() == [0.0, 0.0, 12.0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "finish", "set"]), st.integers(0, 5),
                          st.sampled_from([0.0, 1.0, 3.0])), max_size=40), st.booleans())
def test_the_active_pods_are_exactly_those_with_requests_in_flight_or_work_queued(
        steps: list[tuple[str, int, float]], backlog: bool) -> None:
    """What the sparse choice skips must be idle: no request in flight and (with a backlog) no work left."""
    names = tuple(f"p{j}" for j in range(6))
    snap = build_snapshot(Placement(1, {0: ("p0",)}, {}, pods=names), {})
    load: LoadTable = Backlog(clock=lambda: 0.0) if backlog else LoadTable()
    load.inflight(snap)
    for action, j, value in steps:
        pod = names[j]
        if action == "start":
            load.start(pod, value) if isinstance(load, Backlog) else load.start(pod)
        elif action == "finish":
            load.finish(pod, value) if isinstance(load, Backlog) else load.finish(pod)
        else:
            load.set(pod, value)
        inflight = load.inflight(snap)
        queued = load.outstanding(snap) if isinstance(load, Backlog) else np.zeros(len(names))
        expected = {k for k in range(len(names)) if inflight[k] != 0.0 or queued[k] != 0.0}
        active = load.active(snap).tolist()
        assert sorted(active) == sorted(expected) and len(active) == len(set(active))
