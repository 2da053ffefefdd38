"""``kvshard demo`` with retrieval-stage candidates (the default): the trace's session requests carry the
retrieval stage's items, learnt from other users and from the past only, and the summary puts the served
model beside the stage's own order. The trace runs on real MovieLens in a cheap vector space (genre +
decade instead of MiniLM, as in ``test_demo_report``); the report is fed records whose answers are known."""

from __future__ import annotations

from typing import Any

import pytest

from kvshard.datasets import Dataset
from kvshard.retrieval import RetrievalIndex
from kvshard.splits import UserSplit
from kvshard_bench import demo_report as rep
from kvshard_bench.demo import DemoSettings
from kvshard_bench.demo_trace import DemoTrace, DemoTraceSettings, ItemSpace
from kvshard_bench.routing_sim import item_vectors


@pytest.fixture(scope="module")
def index(movielens: Any) -> RetrievalIndex:
    return RetrievalIndex.fit(movielens, UserSplit())


@pytest.fixture(scope="module")
def space(movielens: Any) -> ItemSpace:
    ids = sorted(movielens.items)
    return ItemSpace.build(movielens, item_vectors(movielens, ids), DemoTraceSettings(), ids)


def trace(dataset: Dataset, space: ItemSpace, index: RetrievalIndex, **overrides: Any) -> DemoTrace:
    settings = DemoTraceSettings(**{"users": 12, "requests_per_user": 4, "candidate_set": "retrieval", **overrides})
    return DemoTrace(dataset, space, settings, index)


def test_the_demo_replays_retrieval_stage_candidates_by_default() -> None:
    assert DemoSettings().candidate_set == "retrieval"
    assert DemoTraceSettings().candidate_set == "neighbours"  # the trace alone keeps its old stream
    with pytest.raises(ValueError, match="candidate_set"):
        DemoTraceSettings(candidate_set="uniform")  # type: ignore[arg-type]


def test_kvshard_demo_takes_the_candidate_set_from_its_flag() -> None:
    from kvshard.cli import build_parser
    from kvshard_bench.demo import settings_from

    for argv, wanted in ((["demo"], "retrieval"), (["demo", "--candidate-set", "neighbours"], "neighbours")):
        assert settings_from(build_parser(argv).parse_args(argv)).candidate_set == wanted


def test_session_requests_carry_the_stages_items_and_keep_the_target_only_if_retrieved(
        movielens: Any, space: ItemSpace, index: RetrievalIndex) -> None:
    t = trace(movielens, space, index)
    requests = [t.next() for _ in range(len(t))]
    assert not {r.user for r in requests} & index.users, "sessions come from users the stage never counted"
    ranks = []
    for r in requests:
        items = movielens.histories[r.user]
        k = items.index(r.target)
        order = [x.item for x in index.retrieve(r.history, 20, exclude=items[:k])]
        assert r.from_retrieval and not r.trending and sorted(r.candidates) == sorted(order)
        assert r.retrieval_rank == (order.index(r.target) if r.target in order else None)
        assert not set(r.candidates) & set(items[:k]), "nothing the user saw before the target"
        assert r.body()["retrieval_scores"] == index.scores(r.history, r.candidates)  # the stage's, in their order
        ranks.append(r.retrieval_rank)
    assert any(rank is None for rank in ranks) and any(rank is not None for rank in ranks)


def test_later_interactions_never_shape_a_requests_candidates(movielens: Any, space: ItemSpace,
                                                              index: RetrievalIndex) -> None:
    t = trace(movielens, space, index)
    # every sampled user's second session target and everything after it rewritten
    rewritten = Dataset(movielens.name, movielens.items,
                        {u: [*h[:-3], "1", "1", "1"] if u in t.sessions else h for u, h in movielens.histories.items()})
    again = trace(rewritten, space, index)
    seen: dict[str, int] = {}
    for before, after in ((t.next(), again.next()) for _ in range(len(t))):
        k = seen[before.user] = seen.get(before.user, -1) + 1
        assert before.user == after.user
        if k <= 1:  # the first request, and the second (whose target and future changed), are as they were
            assert after.candidates == before.candidates and after.history == before.history


def test_burst_requests_keep_the_hot_pool_and_the_target(movielens: Any, space: ItemSpace,
                                                         index: RetrievalIndex) -> None:
    t = trace(movielens, space, index)
    hot = [str(i) for i in range(1, 101)]
    for r in (t.next(hot, 1.0) for _ in range(20)):
        assert r.trending and not r.from_retrieval and r.target in r.candidates
        assert set(r.candidates) - {r.target} <= set(hot)


def test_a_retrieval_trace_without_an_index_is_refused(movielens: Any, space: ItemSpace) -> None:
    with pytest.raises(ValueError, match="retrieval index"):
        DemoTrace(movielens, space, DemoTraceSettings(candidate_set="retrieval"))


def record(index: int, rank: int | None, retrieval_rank: int | None, from_retrieval: bool = True) -> rep.Record:
    return rep.Record(index, "steady", 0.0, 0.1, 200, "a", 1, "t", False, target_rank=rank, num_candidates=20,
                      from_retrieval=from_retrieval, retrieval_rank=retrieval_rank)


def test_the_summary_puts_the_served_model_beside_the_retrieval_order() -> None:
    # four retrieval requests: two targets retrieved (the model puts them first; the stage at 1 and 3),
    # two missed (no rank for either); one burst request that must not count
    records = [record(0, 0, 1), record(1, 0, 3), record(2, None, None), record(3, None, None),
               record(4, 0, None, from_retrieval=False)]
    s = rep.summarize(records, [], [], {}, ["a"], 1.0)
    stage = s["retrieval"]
    assert (stage["requests"], stage["retrieved"], stage["recall"]) == (4, 2, 0.5)
    assert stage["served"]["all"]["hr1"] == 0.5 and stage["served"]["retrieved"]["ndcg10"] == 1.0
    assert stage["retrieval_order"]["all"]["hr1"] == 0.0
    assert stage["retrieval_order"]["retrieved"]["ndcg10"] == pytest.approx((1 / 1.5849625 + 1 / 2.3219281) / 2)
    assert stage["random"]["all"]["hr1"] == pytest.approx(0.025) and stage["random"]["retrieved"]["hr1"] == 0.05
    text = rep.render(s)
    assert "Retrieval-stage candidates: 4 session requests, recall@K 50%" in text
    assert "retrieval order" in text and "served: model + retrieval score" in text


def test_the_served_row_names_the_stage_weight_the_sidecars_fused_with() -> None:
    records = [record(0, 0, 1), record(1, 0, 3)]
    for r in records:
        r.retrieval_weight = 2.0
    s = rep.summarize(records, [], [], {}, ["a"], 1.0)
    assert s["retrieval"]["weights"] == [2.0] and "served: model + 2 × retrieval score" in rep.render(s)


def test_a_summary_without_retrieval_requests_has_no_retrieval_section() -> None:
    s = rep.summarize([record(0, 0, None, from_retrieval=False)], [], [], {}, ["a"], 1.0)
    assert "retrieval" not in s and "Retrieval-stage" not in rep.render(s)
