"""The routing snapshot: exact item → cluster lookups, make-before-break holders, bounded memory."""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshard.placement_schema import Placement, WarmReport
from kvshard_router.snapshot import ItemIndex, PodStatus, build_snapshot, warm_from_reports


def placement(assignment: dict[int, tuple[str, ...]], items: dict[str, int], pods: tuple[str, ...] = ()) -> Placement:
    return Placement(generation=3, assignment=assignment, item_clusters=items, pods=pods)


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(st.text(min_size=0, max_size=12), st.integers(0, 40_000), max_size=300),
    st.lists(st.text(max_size=12), max_size=30),
)
def test_lookup_matches_the_placement_dict_for_known_and_unknown_items(
    items: dict[str, int], probes: list[str]
) -> None:
    index = ItemIndex.from_mapping(items)
    queries = list(items)[:50] + probes
    assert index.lookup(queries).tolist() == [items.get(q, -1) for q in queries]
    assert len(index) == len(items)


def test_lookup_of_nothing_and_in_an_empty_index_is_empty_or_unknown() -> None:
    assert ItemIndex.from_mapping({}).lookup(["a"]).tolist() == [-1]
    assert ItemIndex.from_mapping({"a": 1}).lookup([]).tolist() == []
    assert ItemIndex.from_mapping({"a": 1}).get("b") is None


def test_index_refuses_pickling_because_string_hashes_are_per_process() -> None:
    with pytest.raises(TypeError, match="per-process"):
        pickle.dumps(ItemIndex.from_mapping({"a": 1}))


def test_new_replica_counts_as_holder_only_after_it_reports_warm() -> None:
    p = placement({0: ("a", "b")}, {"x": 0})
    before = build_snapshot(p, {"a": [0]})
    after = build_snapshot(p, {"a": [0], "b": [0]})
    assert before.holders_of(0) == ("a",)
    assert after.holders_of(0) == ("a", "b")


def test_old_holder_keeps_traffic_until_it_stops_reporting_warm() -> None:
    moved = placement({0: ("b",)}, {"x": 0}, pods=("a", "b"))
    assert build_snapshot(moved, {"a": [0]}).holders_of(0) == ("a",)
    assert build_snapshot(moved, {"a": [0], "b": [0]}).holders_of(0) == ("b", "a")
    assert build_snapshot(moved, {"b": [0]}).holders_of(0) == ("b",)


def test_cluster_nobody_warmed_falls_back_to_its_assigned_pods() -> None:
    snap = build_snapshot(placement({0: ("a",), 1: ("b", "c")}, {"x": 1}), {})
    assert snap.holders_of(1) == ("b", "c")


def test_warm_reports_from_pods_outside_the_placement_are_ignored() -> None:
    reports = {"gone": WarmReport(2, (0,)), "a": WarmReport(1, (0,))}
    snap = build_snapshot(placement({0: ("a",)}, {"x": 0}), warm_from_reports(reports))
    assert snap.pods == ("a",)
    assert snap.holders_of(0) == ("a",)


def test_cached_tokens_credits_each_holder_with_its_items_tokens() -> None:
    p = placement({0: ("a",), 1: ("b", "c"), 2: ("c",)}, {"x": 0, "y": 1, "z": 2, "w": 1})
    snap = build_snapshot(p, {"a": [0], "b": [1], "c": [1, 2]})
    credit = snap.cached_tokens(snap.clusters_of(["x", "y", "w", "nope"]), [5, 7, 11, 13])
    assert dict(zip(snap.pods, credit.tolist(), strict=True)) == {"a": 5.0, "b": 18.0, "c": 18.0}


def test_with_health_shares_arrays_and_changes_only_named_pods() -> None:
    snap = build_snapshot(placement({0: ("a", "b")}, {"x": 0}), {}, [PodStatus("a"), PodStatus("b", healthy=False)])
    assert snap.healthy.tolist() == [True, False]
    flipped = snap.with_health({"a": False, "b": True})
    assert flipped.healthy.tolist() == [False, True]
    assert flipped.healthy_indices.tolist() == [1]
    assert flipped.items is snap.items and flipped.holders is snap.holders


def test_index_memory_is_about_eleven_bytes_per_item() -> None:
    n = 1_000_000
    ids = [f"item-{i}" for i in range(n)]
    index = ItemIndex.from_items(ids, np.arange(n) % 5000)
    assert index.nbytes <= 11 * n
    probe = [ids[7], ids[n - 1], "item-x"]
    assert index.lookup(probe).tolist() == [7 % 5000, (n - 1) % 5000, -1]


class _LazyIds:
    """10 M item ids without holding 10 M strings (~700 MB) at once."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return (f"item-{i}" for i in range(self.n))

    def __getitem__(self, i: int) -> str:
        return f"item-{i}"


@pytest.mark.slow
def test_ten_million_items_fit_in_110_mb_and_look_up_in_microseconds() -> None:
    n, clusters = 10_000_000, 10_000
    labels = np.random.default_rng(0).integers(0, clusters, n)
    index = ItemIndex.from_items(_LazyIds(n), labels)  # type: ignore[arg-type]
    assert index.nbytes <= 110 * 10**6
    pods = tuple(f"pod-{i:04d}" for i in range(1000))
    p = Placement(1, {c: (pods[c % 1000],) for c in range(clusters)}, {}, pods=pods)
    snap = build_snapshot(p, {}, items=index)
    assert snap.nbytes <= 110 * 10**6
    probe = [f"item-{i}" for i in range(0, n, n // 50)]
    started = time.perf_counter()
    found = snap.clusters_of(probe)
    assert time.perf_counter() - started < 0.05
    assert found.tolist() == labels[:: n // 50].tolist()


def test_items_whose_hashes_collide_are_still_looked_up_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvshard_router import snapshot as module

    def weak(ids: Iterable[str], count: int) -> npt.NDArray[np.uint64]:
        return np.fromiter((hash(i) % 3 for i in ids), dtype=np.int64, count=count).view(np.uint64)

    monkeypatch.setattr(module, "_hashes", weak)
    items = {f"item-{i}": i for i in range(40)}
    index = ItemIndex.from_mapping(items)
    assert index.lookup(list(items)).tolist() == list(range(40))
    assert len(index) == 40


@pytest.mark.parametrize("widest", [2, 12])  # two replicas, and clusters held by up to 12 pods
def test_cached_tokens_match_a_plain_sum_over_holders(widest: int) -> None:
    rng = np.random.default_rng(widest)
    pods = tuple(f"p{j}" for j in range(20))
    assignment = {c: tuple(rng.choice(pods, size=int(rng.integers(1, widest + 1)), replace=False).tolist())
                  for c in range(30)}
    items = {f"i{j}": int(rng.integers(0, 30)) for j in range(200)}
    warm = {p: [c for c, h in assignment.items() if p in h and rng.random() < 0.7] for p in pods}
    snap = build_snapshot(Placement(1, assignment, items, pods=pods), warm)
    ids = [*rng.choice(list(items), size=25).tolist(), "unknown"]
    tokens = rng.integers(1, 50, size=len(ids))
    expected = np.zeros(len(pods))
    for item, t in zip(ids, tokens, strict=True):
        if item in items:
            for pod in snap.holders_of(items[item]):
                expected[snap.pod_index[pod]] += t
    assert np.array_equal(snap.cached_tokens(snap.clusters_of(ids), tokens), expected)
