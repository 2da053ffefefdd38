"""The pure parts of ``kvshard demo``: the replayed trace, the summary arithmetic and the picture.

The full run (local cluster, router, sidecars) is ``make demo``; here the trace is built on the real
MovieLens data in a cheap vector space (genre + decade instead of MiniLM: the trace takes vectors,
it does not care which), and the report is fed hand-made records whose right answers are known; the
fidelity guard's table is fed CacheShard objects shaped as the operator writes them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvshard_bench import demo_fidelity as fid
from kvshard_bench import demo_report as rep
from kvshard_bench.demo_trace import DemoTrace, DemoTraceSettings, ItemSpace, items_in, pick_hot_clusters
from kvshard_bench.routing_sim import item_vectors
from kvshard_local.testing_servers import EtcdServer


@pytest.fixture(scope="module")
def space_vectors(movielens: Any) -> tuple[list[str], Any]:
    ids = sorted(movielens.items)
    return ids, item_vectors(movielens, ids)


def make_trace(movielens: Any, vectors: tuple[list[str], Any], **overrides: Any) -> DemoTrace:
    settings = DemoTraceSettings(**{"users": 12, "requests_per_user": 4, **overrides})
    ids, x = vectors
    return DemoTrace(movielens, ItemSpace.build(movielens, x, settings, ids), settings)


# ------------------------------------------------------------------------------------------ trace


def test_the_same_seed_gives_the_same_requests_and_another_seed_others(movielens: Any, space_vectors: Any) -> None:
    first = make_trace(movielens, space_vectors)
    second = make_trace(movielens, space_vectors)
    other = make_trace(movielens, space_vectors, seed=7)
    run1 = [first.next() for _ in range(30)]
    assert run1 == [second.next() for _ in range(30)]
    assert [r.candidates for r in run1] != [other.next().candidates for _ in range(30)]


def test_each_user_keeps_one_history_and_asks_for_their_next_items_in_order(movielens: Any,
                                                                            space_vectors: Any) -> None:
    trace = make_trace(movielens, space_vectors)
    requests = [trace.next() for _ in range(len(trace))]
    assert len(requests) == 12 * 4 and [r.index for r in requests] == list(range(48))
    by_user: dict[str, list[Any]] = {}
    for r in requests:
        by_user.setdefault(r.user, []).append(r)
    assert len(by_user) == 12
    for user, reqs in by_user.items():
        items = movielens.histories[user]
        assert len({r.history for r in reqs}) == 1, "a user's history block must repeat"
        assert len(reqs[0].history) == 20
        assert [r.target for r in reqs] == items[-4:]  # their actual next ratings, in order
        assert list(reqs[0].history) == items[-24:-4]
        for r in reqs:
            assert len(r.candidates) == 20 and len(set(r.candidates)) == 20
            assert r.target in r.candidates
            assert not set(r.candidates) & set(r.history)
            assert not r.trending
    body = requests[0].body(max_tokens=1)
    assert body == {"user_id": requests[0].user, "history": list(requests[0].history),
                    "candidates": list(requests[0].candidates), "max_tokens": 1}


def test_candidates_are_neighbours_of_the_recent_items(movielens: Any, space_vectors: Any) -> None:
    trace = make_trace(movielens, space_vectors)
    space = trace.space
    inside = total = 0
    for _ in range(len(trace)):
        r = trace.next()
        pool = {space.ids[j] for i in r.history[-5:] for j in space.neighbours[space.row[i]]}
        others = [c for c in r.candidates if c != r.target]
        inside += sum(c in pool for c in others)
        total += len(others)
    assert inside / total > 0.95


def test_zipf_skew_draws_popular_items_more_often(movielens: Any, space_vectors: Any) -> None:
    counts = np.bincount([i for h in movielens.histories.values() for i in map(int, h)])

    def mean_ratings(zipf: float) -> float:
        trace = make_trace(movielens, space_vectors, zipf=zipf, neighbours=120)
        picks = [int(c) for _ in range(len(trace)) for r in [trace.next()] for c in r.candidates if c != r.target]
        return float(np.mean(counts[picks]))

    assert mean_ratings(1.5) > 1.5 * mean_ratings(0.0)


def test_trending_requests_take_their_candidates_from_the_hot_pool(movielens: Any, space_vectors: Any) -> None:
    trace = make_trace(movielens, space_vectors)
    hot = [str(i) for i in range(1, 101)]
    all_hot = [trace.next(hot, 1.0) for _ in range(40)]
    assert all(r.trending for r in all_hot)
    for r in all_hot:
        assert set(r.candidates) - {r.target} <= set(hot)
        assert r.target in r.candidates
    assert not any(trace.next(hot, 0.0).trending for _ in range(40))
    share = sum(trace.next(hot, 0.5).trending for _ in range(200)) / 200
    assert 0.35 < share < 0.65


def test_the_stream_wraps_around_when_a_phase_needs_more(movielens: Any, space_vectors: Any) -> None:
    trace = make_trace(movielens, space_vectors, users=2, requests_per_user=2)
    requests = [trace.next() for _ in range(9)]
    assert [r.index for r in requests] == list(range(9))
    assert [(r.user, r.target) for r in requests[4:8]] == [(r.user, r.target) for r in requests[:4]]


def test_the_space_refuses_misaligned_embeddings(movielens: Any, space_vectors: Any) -> None:
    ids, x = space_vectors
    with pytest.raises(ValueError, match="embeddings for"):
        ItemSpace.build(movielens, x[:-1], DemoTraceSettings(), ids)


def test_the_hot_clusters_are_the_largest_ones_only_one_pod_holds() -> None:
    assignment = {0: ("pod-b",), 1: ("pod-b",), 2: ("pod-a", "pod-b"), 3: ("pod-a",), 4: ("pod-b",), 5: ("pod-c",)}
    item_clusters = {"1": 0, "2": 1, "3": 1, "4": 4, "5": 4, "6": 4, "7": 2, "8": 2, "9": 2, "10": 2}
    assert pick_hot_clusters(assignment, item_clusters, 2) == ("pod-b", [1, 4])
    assert pick_hot_clusters(assignment, item_clusters, 1) == ("pod-b", [4])
    # a tie on the number of clusters goes to the first pod by name
    assert pick_hot_clusters({0: ("y",), 1: ("x",)}, {"1": 0, "2": 1}, 1) == ("x", [1])
    assert items_in(item_clusters, [1, 4]) == ["2", "3", "4", "5", "6"]
    with pytest.raises(ValueError, match="no cluster"):
        pick_hot_clusters({}, item_clusters)


# ---------------------------------------------------------------------------------------- report


def record(index: int, phase: str = "steady", pod: str | None = "pod-a", status: int = 200, **kw: Any) -> rep.Record:
    return rep.Record(index=index, phase=phase, sent_s=float(index), latency_s=0.5, status=status, pod=pod,
                      generation=1, target="1", trending=False, **kw)


def test_hit_table_counts_tiers_and_the_computed_rest_of_each_kind() -> None:
    records = [
        record(0, query={"item": 100, "history": 50, "instruction": 10},
               hit={"item": {"memory": 60, "disk": 20}, "history": {"memory": 50}}),
        record(1, query={"item": 100, "history": 50, "instruction": 10},
               hit={"item": {"peer": 40}, "history": {"disk": 50}}),
        record(2, status=429, query={"item": 1000}),  # a failed request counts for nothing
    ]
    table = rep.hit_table(records)
    assert list(table) == ["history", "item", "instruction"]
    assert table["item"] == {"query": 200, "memory": 60, "disk": 20, "peer": 40, "computed": 80}
    assert table["history"] == {"query": 100, "memory": 50, "disk": 50, "peer": 0, "computed": 0}
    assert table["instruction"]["computed"] == 20
    assert rep.hit_ratio(table["item"]) == pytest.approx(0.6)
    assert rep.hit_ratio(table["instruction"]) == 0.0


def test_percentiles_match_numpy() -> None:
    values = list(np.random.default_rng(3).gamma(2.0, 50.0, size=101))
    for q in (0, 50, 90, 99, 100):
        assert rep.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert rep.percentile([], 50) is None


def test_load_share_lists_idle_pods_and_imbalance_is_max_over_mean() -> None:
    records = [record(0, pod="a"), record(1, pod="a"), record(2, pod="b"), record(3, pod="a", status=503)]
    shares = rep.load_share(records, ["a", "b", "c"])
    assert shares == pytest.approx({"a": 2 / 3, "b": 1 / 3, "c": 0.0})
    assert rep.imbalance(shares) == pytest.approx(2.0)
    assert rep.imbalance({"a": 0.5, "b": 0.5}) == 1.0


def test_round_robin_and_held_share() -> None:
    assert [rep.round_robin_pod(i, ["a", "b", "c"]) for i in range(5)] == ["a", "b", "c", "a", "b"]
    assert rep.round_robin_pod(3, []) is None
    clusters = {"1": 0, "2": 0, "3": 1, "4": 2}
    assert rep.held_share(["1", "2", "3", "4", "unknown"], clusters, [0, 2]) == pytest.approx(0.6)
    assert rep.held_share([], clusters, [0]) == 0.0


def test_placement_changes_name_what_each_cluster_gained_and_lost() -> None:
    old = {0: ("a",), 1: ("b",), 2: ("c",)}
    new = {0: ("a", "c"), 1: ("a",), 2: ("c",)}
    assert rep.placement_changes(old, new) == ["cluster 0: +c", "cluster 1: +a -b"]
    assert rep.placement_changes(old, old) == []


def _summary_inputs() -> tuple[list[rep.Record], list[rep.PrefillPair], list[rep.PlacementSample]]:
    records = []
    for i in range(10):
        phase = "steady" if i < 4 else "burst" if i < 7 else "after"
        pod = "a" if phase == "burst" else ("a", "b")[i % 2]
        records.append(record(i, phase=phase, pod=pod, ttft_ms=10.0 + i, query={"item": 10},
                              hit={"item": {"memory": 8}}, held=0.8, rr_held=0.4, label="A",
                              candidate="1" if i % 2 else "2", target_rank=0 if i % 2 else 7, num_candidates=20))
    pairs = [rep.PrefillPair(i, "a", 10.0, 25.0, "A", "A" if i else "B", blended_rank=i, full_rank=0,
                             num_candidates=20) for i in range(4)]
    samples = [rep.PlacementSample(0.0, 1, {"a": 2, "b": 2}, {"a": 2, "b": 2}),
               rep.PlacementSample(6.0, 2, {"a": 2, "b": 3}, {"a": 2, "b": 2})]
    return records, pairs, samples


def test_summary_numbers() -> None:
    records, pairs, samples = _summary_inputs()
    s = rep.summarize(records, pairs, samples, {2: ["cluster 0: +b"]}, ["a", "b"], 42.0, notes={"x": "y"})
    assert (s["requests"], s["ok"], s["errors"], s["wall_s"]) == (10, 10, 0, 42.0)
    assert s["ttft_ms"]["speedup_p50"] == pytest.approx(2.5)
    assert s["ttft_ms"]["replay_p50"] == pytest.approx(14.5)
    assert s["agreement"] == pytest.approx(0.75)
    replay, blended, full = (s["quality"][k] for k in ("replay", "blended", "full"))
    assert (replay["requests"], replay["hr1"], replay["hr5"]) == (10, pytest.approx(0.5), pytest.approx(0.5))
    assert replay["ndcg10"] == pytest.approx(0.5 + 0.5 / math.log2(9))
    assert (replay["random_hr1"], replay["random_hr5"]) == (pytest.approx(0.05), pytest.approx(0.25))
    assert (blended["hr1"], blended["hr5"], full["hr1"]) == (pytest.approx(0.25), 1.0, 1.0)
    assert s["placement_hit"] == {"router": pytest.approx(0.8), "round_robin": pytest.approx(0.4)}
    assert s["phases"]["burst"]["share"] == {"a": 1.0, "b": 0.0}
    assert s["phases"]["burst"]["imbalance"] == pytest.approx(2.0)
    assert s["phases"]["steady"]["imbalance"] == pytest.approx(1.0)
    assert s["generations"] == {"1": 0.0, "2": 6.0}
    assert s["hits"]["item"]["memory"] == 80
    text = rep.render(s)
    for needle in ("Hit ratio per segment kind and tier", "80.0%", "round-robin", "2.50x", "75%", "HR@5",
                   "burst, before rebalance", "generation 2: cluster 0: +b", "x: y"):
        assert needle in text
    lines = text.splitlines()
    block = lines[lines.index("Per-pod request share per phase") + 1:]
    table = block[: block.index("")]
    assert len({len(line) for line in table}) == 1, "the columns must line up"


def test_the_target_rank_is_read_from_the_answers_ranking() -> None:
    answer = {"ranking": [{"candidate": "9"}, {"candidate": "4"}, {"candidate": "2"}]}
    assert rep.target_rank(answer, "4") == 1
    assert rep.target_rank(answer, "7") is None and rep.target_rank({"text": "A"}, "4") is None


def test_summary_of_nothing_does_not_divide_by_zero() -> None:
    s = rep.summarize([], [], [], {}, ["a"], 1.0)
    assert s["agreement"] is None and s["ttft_ms"]["speedup_p50"] is None
    assert s["quality"]["replay"] == {"requests": 0, "hr1": None, "hr5": None, "ndcg10": None,
                                      "random_hr1": None, "random_hr5": None, "random_ndcg10": None}
    assert "requests 0" in rep.render(s)


def test_plot_writes_a_png_with_two_panels(tmp_path: Path) -> None:
    import matplotlib.image

    records, _, samples = _summary_inputs()
    path = rep.plot(records, samples, ["a", "b"], tmp_path / "out" / "placement.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(path).shape[:2]
    assert (width, height) == (1320, 770)
    assert path.stat().st_size > 10_000


# -------------------------------------------------------------------------------- fidelity guard


def _shard(ratio: int | None, samples: int | None = None, agreement: int | None = None, *, met: str = "Unknown",
           reason: str = "InsufficientSamples", at: str | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True"},
                                             {"type": "FidelityMet", "status": met, "reason": reason}]}
    if ratio is not None:
        status["blend"] = {"method": "tail", "ratioPercent": ratio, "reason": "FidelityController"}
    if samples is not None:
        status["fidelity"] = {"samples": samples, "agreementPercent": agreement, "lowerBoundPercent": 50,
                              "windowSeconds": 60, "lastDecisionTime": at}
    return {"spec": {}, "status": status}


def _guard_run() -> list[fid.FidelitySample]:
    """Polls of one run: start at 30 %, too few checks, then below target → 40 %, then met at 40 %."""
    polls = [_shard(30), _shard(30), _shard(30, 2, 100, at="T1"), _shard(30, 2, 100, at="T1"),
             _shard(40, 9, 77, met="False", reason="BelowTarget", at="T2"),
             _shard(40, 14, 100, met="True", reason="MeetsTarget", at="T3"),
             _shard(40, 14, 100, met="True", reason="MeetsTarget", at="T3")]
    out = [fid.sample_of(shard, 3.0 * i) for i, shard in enumerate(polls)]
    assert all(sample is not None for sample in out)
    return [sample for sample in out if sample is not None]


def test_the_demo_fidelity_spec_is_sized_to_the_demo_and_bounded_like_the_crd() -> None:
    assert fid.fidelity_spec(90, 10, 20) == {"targetAgreementPercent": 90, "sampleRatePercent": 10,
                                             "intervalSeconds": 20, "windowSeconds": 60, "minSamples": 5}
    for bad in ((0, 10, 20), (101, 10, 20), (90, 0, 20), (90, 10, 9)):
        with pytest.raises(ValueError):
            fid.fidelity_spec(*bad)


def test_a_fidelity_sample_is_read_from_the_cacheshards_status() -> None:
    assert fid.sample_of({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}, 1.0) is None
    assert fid.sample_of({}, 1.0) is None
    sample = fid.sample_of(_shard(40, 9, 77, met="False", reason="BelowTarget", at="T2"), 12.0)
    assert sample == fid.FidelitySample(12.0, 40, 9, 77, 50, "False", "BelowTarget", "T2")
    assert fid.sample_of(_shard(30), 0.0) == fid.FidelitySample(0.0, 30, met="Unknown", reason="InsufficientSamples")


def test_the_fidelity_table_keeps_one_row_per_change_and_counts_the_ladder_steps() -> None:
    samples = _guard_run()
    assert [s.t for s in fid.changes(samples)] == [0.0, 6.0, 12.0, 15.0]
    spec = fid.fidelity_spec(90, 10, 20)
    section = fid.summarize(samples, spec)
    assert (section["ratio_start_percent"], section["ratio_end_percent"], section["steps"]) == (30, 40, 1)
    assert section["decisions"] == 3 and section["fidelity_met"] == "True (MeetsTarget)"
    assert [r["agreement_percent"] for r in section["rows"]] == [None, 100, 77, 100]
    lines = fid.render(section)
    assert lines[0].startswith("Fidelity guard: target 90 % agreement") and "10 % of requests" in lines[0]
    table = lines[1:7]
    assert table[0].split() == ["time", "ratio", "samples", "agreement", "lower", "bound", "FidelityMet"]
    assert table[4].split()[:5] == ["12", "s", "40%", "9", "77%"] and table[4].endswith("False (BelowTarget)")
    assert table[2].split()[:4] == ["0", "s", "30%", "—"]
    assert "ratio in force 30% → 40% (1 ladder steps, 3 decisions seen)" in lines
    assert fid.render(fid.summarize([], spec))[1].strip().startswith("the CacheShard reported no blend")
    steady = [fid.FidelitySample(float(t), 20, 30, 95, 88, "True", "MeetsTarget", f"T{t}") for t in range(3)]
    assert fid.summarize(steady, spec)["steps"] == 0


def test_the_summary_carries_the_fidelity_section_and_prints_its_table() -> None:
    records, pairs, samples = _summary_inputs()
    section = fid.summarize(_guard_run(), fid.fidelity_spec(90, 10, 20))
    s = rep.summarize(records, pairs, samples, {}, ["a", "b"], 42.0, fidelity=section)
    assert s["fidelity"]["steps"] == 1
    text = rep.render(s)
    assert "Fidelity guard: target 90 %" in text and "False (BelowTarget)" in text
    assert "fidelity" not in rep.summarize(records, pairs, samples, {}, ["a", "b"], 42.0)


def test_plot_adds_a_fidelity_panel_with_a_target(tmp_path: Path) -> None:
    import matplotlib.image

    records, _, samples = _summary_inputs()
    path = rep.plot(records, samples, ["a", "b"], tmp_path / "placement.png", fidelity=_guard_run(),
                    target_percent=90)
    height, width = matplotlib.image.imread(path).shape[:2]
    assert (width, height) == (1320, 1100)


# ----------------------------------------------------------------------------- watch (real etcd)


async def test_the_watch_follows_generations_and_says_when_the_hot_clusters_are_spread(etcd: EtcdServer) -> None:
    from kvshard.placement_schema import Placement, WarmReport
    from kvshard_bench import demo_watch

    items = {"1": 0, "2": 0, "3": 1, "4": 2}
    pods = ("a", "b", "c")
    clock = [0.0]
    shard: dict[str, Any] = {"status": {"conditions": [{"type": "Rebalancing", "status": "False", "reason": "Idle"}]}}
    async with etcd.store() as store:
        watch = demo_watch.PlacementWatch(store, "ns", "shop", lambda: shard, lambda: clock[0])
        await watch.poll()
        assert watch.current is None and watch.samples == []
        await store.publish("ns", "shop", Placement(1, {0: ("a",), 1: ("b",), 2: ("c",)}, items, pods), expected=0)
        for pod, clusters in (("a", (0,)), ("b", (1,)), ("c", (2,))):
            await store.put_warm("ns", "shop", pod, WarmReport(1, clusters))
        await watch.poll()
        assert watch.generation == 1 and watch.samples[-1].assigned == {"a": 1, "b": 1, "c": 1}
        assert not watch.rebalanced(1, [0], "a")  # no newer generation yet

        clock[0] = 10.0
        await store.publish("ns", "shop", Placement(2, {0: ("a", "b"), 1: ("b",), 2: ("c",)}, items, pods),
                            expected=1)
        await watch.poll()
        assert watch.generation == 2 and watch.changes() == {2: ["cluster 0: +b"]}
        assert not watch.rebalanced(1, [0], "a"), "b has not warmed cluster 0 yet"
        await store.put_warm("ns", "shop", "b", WarmReport(2, (0, 1)))
        await watch.poll()
        assert watch.rebalanced(1, [0], "a")
        assert not watch.rebalanced(1, [0, 2], "a"), "every hot cluster must be spread"
        clock[0] = 10.0 + demo_watch.SETTLE_SECONDS + 1
        assert watch.rebalanced(1, [0, 2], "a"), "after the settle time the burst ends anyway"
        assert [s.generation for s in watch.samples] == [1, 2, 2]
        assert watch.samples[-1].warm == {"b": 2}

        await watch.poll_conditions()
        assert watch.fidelity == [], "no blend in force reported: nothing to show"
        shard["status"]["conditions"][0].update(status="True", reason="Rebalanced")
        shard["status"]["blend"] = {"method": "tail", "ratioPercent": 30}
        await watch.poll_conditions()
        await watch.poll_conditions()
        assert watch.rebalances == 1 and watch.conditions["Rebalancing"].startswith("True (Rebalanced")
        assert [(s.t, s.ratio_percent) for s in watch.fidelity] == [(clock[0], 30), (clock[0], 30)]
