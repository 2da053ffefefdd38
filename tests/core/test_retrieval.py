"""The retrieval stage (:mod:`kvshard.retrieval`): what it retrieves, what it may learn from, and how it
is scored — on hand-made histories whose right answers are known, and on MovieLens for the invariants."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvshard.datasets import Dataset, Item
from kvshard.prompts import RecommendationRequest, sample_requests, target_positions
from kvshard.retrieval import (
    RetrievalIndex,
    RetrievedRequest,
    quality_or_miss,
    recall,
    retrieval_requests,
    retrieved_request,
)
from kvshard.splits import UserSplit

ITEMS = ("h", "paired", "also", "popular", "x", "y", "z", "cold")
"""Toy catalog: "paired" co-occurs with "h" more than "also" does; "popular" is rated most, never with "h"."""


def toy(histories: dict[str, list[str]]) -> Dataset:
    return Dataset("toy", {i: Item(i, i) for i in ITEMS}, histories)


TRAINING = {"a": ["h", "paired", "also"], "b": ["h", "paired"], "c": ["popular", "x"], "d": ["popular", "y"],
            "e": ["popular", "z"], "f": ["also", "x"]}


def split_holding_out(dataset: Dataset, wanted: set[str]) -> UserSplit:
    """A split (a real salted hash) that holds out exactly ``wanted`` among ``dataset``'s users."""
    for salt in range(10_000):
        for fraction in (0.2, 0.3, 0.4, 0.5):
            split = UserSplit(fraction, f"salt-{salt}")
            if set(split.heldout_users(dataset)) == wanted:
                return split
    raise AssertionError(f"no salt holds out exactly {wanted}")


# --------------------------------------------------------------------------------------- retrieve


def test_neighbours_of_the_history_come_first_then_the_most_popular_items() -> None:
    index = RetrievalIndex(TRAINING, ITEMS)
    got = index.retrieve(["h"], 5)
    assert [r.item for r in got] == ["paired", "also", "popular", "x", "y"]
    assert [r.source for r in got] == ["knn", "knn", "popular", "popular", "popular"]
    # cosine co-occurrence: paired shares 2 users of h's 2 (2/sqrt(2*2)); also 1 of 2 and 2 (1/sqrt(2*2))
    assert got[0].score == pytest.approx(1.0) and got[1].score == pytest.approx(0.5) and got[2].score == 0.0


def test_the_history_and_the_users_earlier_items_are_never_retrieved() -> None:
    index = RetrievalIndex(TRAINING, ITEMS)
    got = [r.item for r in index.retrieve(["h", "popular"], 5, exclude=["x", "h"])]
    assert not {"h", "popular", "x"} & set(got) and len(got) == len(set(got)) == 5


def test_an_item_nobody_interacted_with_is_retrieved_last_and_too_few_items_is_an_error() -> None:
    index = RetrievalIndex(TRAINING, ITEMS)
    assert index.retrieve(["h"], 7)[-1].item == "cold"
    with pytest.raises(ValueError, match="only 7 items are left"):
        index.retrieve(["h"], 8)
    with pytest.raises(ValueError, match="at least 1"):
        index.retrieve(["h"], 0)


def test_retrieval_is_deterministic_whatever_the_order_users_were_counted_in() -> None:
    forward = RetrievalIndex(TRAINING, ITEMS)
    backward = RetrievalIndex(dict(reversed(list(TRAINING.items()))), reversed(ITEMS))
    assert forward.retrieve(["h", "x"], 6) == backward.retrieve(["h", "x"], 6)


# ------------------------------------------------------------------------------------ what it sees


def test_held_out_users_never_feed_the_statistics() -> None:
    # "t" would make "target" h's nearest neighbour; held out, it must change nothing
    histories = {**TRAINING, "t": ["h", "cold", "cold2", "h2"]}
    dataset = Dataset("toy", {i: Item(i, i) for i in (*ITEMS, "cold2", "h2")}, histories)
    split = split_holding_out(dataset, {"t"})
    fitted = RetrievalIndex.fit(dataset, split)
    without = RetrievalIndex.fit(Dataset("toy", dataset.items, {**TRAINING, "t": ["x"]}), split)
    assert "t" not in fitted.users
    assert fitted.retrieve(["h"], 5) == without.retrieve(["h"], 5)
    # the same data, trained on, does change the neighbours: the assertion above can fail
    assert RetrievalIndex(histories, dataset.items).retrieve(["h"], 5) != fitted.retrieve(["h"], 5)


def test_fit_counts_training_users_only_before_their_second_to_last_item() -> None:
    # the validation target (second-to-last) and the last item are never in the counts
    histories = {u: [*h, "cold", "z"] for u, h in TRAINING.items()}
    index = RetrievalIndex.fit(toy(histories), UserSplit(0.0))
    assert index.count("cold") == 0 and index.count("z") == 1  # only e's own earlier "z"
    assert index.retrieve(["h"], 5) == RetrievalIndex(TRAINING, ITEMS).retrieve(["h"], 5)


def test_requests_refuse_users_whose_own_data_is_in_the_counts() -> None:
    dataset = toy({**TRAINING})
    with pytest.raises(ValueError, match="in the retrieval statistics"):
        retrieval_requests(dataset, RetrievalIndex(TRAINING, ITEMS), users=3, history=1, candidates=3)


# ------------------------------------------------------------------------------------ requests


def test_the_future_never_shapes_a_requests_candidates() -> None:
    index = RetrievalIndex(TRAINING, ITEMS)
    past = ["y", "h"]
    one = retrieved_request(index, random.Random(3), "u", past, "paired", history=1, candidates=4)
    # another target (the user's real next item is unknown to the stage) and nothing else changes
    other = retrieved_request(index, random.Random(3), "u", past, "z", history=1, candidates=4)
    assert one.order == other.order and one.request.candidates == other.request.candidates
    assert one.request.history == ("h",) and "y" not in one.order  # earlier items are excluded, not queried


def test_the_target_is_kept_only_where_retrieved_never_inserted(movielens: Any) -> None:
    split = UserSplit()
    stage = retrieval_requests(split.heldout_dataset(movielens), RetrievalIndex.fit(movielens, split),
                               users=60, history=10, candidates=20, seed=1)
    assert 0 < recall(stage) < 1, "the stage retrieves some targets and misses others"
    for r in stage:
        request, items = r.request, movielens.histories[r.request.user_id]
        assert sorted(request.candidates) == sorted(r.order) and len(set(r.order)) == 20
        assert (request.target_index is not None) == r.retrieved == (items[-1] in r.order)
        assert request.target == items[-1] and request.history == tuple(items[-11:-1])
        assert not set(r.order) & set(items[:-1]), "nothing the user saw before the target"
        assert list(r.scores) == sorted(r.scores, reverse=True)


def test_requests_are_seeded_and_sample_the_same_users_as_uniform_negatives(movielens: Any) -> None:
    split = UserSplit()
    heldout, index = split.heldout_dataset(movielens), RetrievalIndex.fit(movielens, split)
    first = retrieval_requests(heldout, index, users=15, history=5, candidates=20, seed=4)
    assert first == retrieval_requests(heldout, index, users=15, history=5, candidates=20, seed=4)
    uniform = sample_requests(heldout, users=15, history=5, candidates=20, seed=4)
    assert [r.request.user_id for r in first] == [r.user_id for r in uniform]
    other = retrieval_requests(heldout, index, users=15, history=5, candidates=20, seed=5)
    assert [r.request.candidates for r in first] != [r.request.candidates for r in other]


def test_earlier_positions_add_requests_without_the_target_or_its_future_and_keep_the_last_items(
        movielens: Any) -> None:
    split = UserSplit()
    heldout, index = split.heldout_dataset(movielens), RetrievalIndex.fit(movielens, split)
    last = retrieval_requests(heldout, index, users=12, history=10, candidates=20, seed=2)
    five = retrieval_requests(heldout, index, users=12, history=10, candidates=20, seed=2, positions=5)
    assert five[::5] == last, "adding positions leaves the last items' requests as they were"
    uniform = sample_requests(heldout, users=12, history=10, candidates=20, seed=2, positions=5)
    assert [r.request.user_id for r in five] == [r.user_id for r in uniform]
    assert uniform[::5] == sample_requests(heldout, users=12, history=10, candidates=20, seed=2)
    for number, (staged_request, sampled) in enumerate(zip(five, uniform, strict=True)):
        items = movielens.histories[sampled.user_id]
        end = len(items) - 1 - number % 5  # every held-out user has 15 interactions or more
        for request in (staged_request.request, sampled):
            assert request.target == items[end] and request.history == tuple(items[end - 10:end])
        assert not set(staged_request.order) & set(items[:end]), "nothing the user saw before the target"
        assert sampled.target in sampled.candidates
        assert not (set(sampled.candidates) - {sampled.target}) & set(items), "negatives: never the user's items"
    with pytest.raises(ValueError, match="positions"):
        retrieval_requests(heldout, index, users=1, history=10, candidates=20, positions=0)


def test_a_position_without_enough_history_before_it_is_skipped() -> None:
    assert target_positions(20, history=10, positions=5) == [19, 18, 17, 16, 15]
    assert target_positions(12, history=10, positions=5) == [11, 10]
    assert target_positions(10, history=10, positions=1) == []


# -------------------------------------------------------------------------------------- scoring


def staged(target: str, order: tuple[str, ...]) -> RetrievedRequest:
    return RetrievedRequest(RecommendationRequest("u", ("h",), order, target), order)


def test_recall_is_the_share_of_targets_retrieved_and_a_miss_scores_zero() -> None:
    stage = [staged("a", ("a", "b")), staged("b", ("a", "b")), staged("c", ("a", "b")), staged("d", ("a", "b"))]
    assert recall(stage) == 0.5 and recall([]) == 0.0
    assert [r.retrieval_rank for r in stage] == [0, 1, None, None]
    assert quality_or_miss(None) == {"hr1": 0.0, "hr5": 0.0, "ndcg10": 0.0}
    assert quality_or_miss(0) == {"hr1": 1.0, "hr5": 1.0, "ndcg10": 1.0}
    assert quality_or_miss(1) == {"hr1": 0.0, "hr5": 1.0, "ndcg10": pytest.approx(1 / 1.5849625)}
    assert quality_or_miss(10)["ndcg10"] == 0.0
