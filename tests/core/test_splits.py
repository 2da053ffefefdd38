"""The fine-tuning split: a user's last interaction is only ever a test target; held-out users never train."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from kvshard.datasets import Dataset, Item
from kvshard.retrieval import RetrievalIndex
from kvshard.splits import UserSplit, training_positions, training_requests, validation_requests


def _synthetic(users: int = 30, length: int = 12, catalog: int = 200) -> Dataset:
    items = {str(i): Item(str(i), f"Movie {i} (199{i % 10}), Drama") for i in range(catalog)}
    histories = {f"u{u}": [str((u * 7 + k * 13) % catalog) for k in range(length + u % 5)] for u in range(users)}
    return Dataset("synthetic", items, histories)


@pytest.fixture(scope="module")
def synthetic() -> Dataset:
    return _synthetic()


def test_training_never_contains_a_users_last_interaction(movielens: Any) -> None:
    split = UserSplit()
    users = split.training_users(movielens)
    requests = training_requests(movielens, users, history=10, candidates=20, count=3000, seed=3, window=30)
    assert len(requests) == 3000
    for request in requests:
        items = movielens.histories[request.user_id]
        last, second_last = items[-1], items[-2]
        assert request.target not in (last, second_last)
        assert last not in request.history and last not in request.candidates
        assert second_last not in request.history and second_last not in request.candidates
        position = items.index(request.target)
        assert request.history == tuple(items[position - 10:position])  # only earlier items as history
        assert not (set(request.candidates) - {request.target}) & set(items)  # negatives the user never saw


def test_training_positions_stop_before_the_validation_target(synthetic: Dataset) -> None:
    for user, position in training_positions(synthetic, synthetic.histories, history=3, window=0):
        assert 3 <= position < len(synthetic.histories[user]) - 2


def test_window_keeps_the_positions_closest_to_the_validation_target(synthetic: Dataset) -> None:
    positions = training_positions(synthetic, ["u0"], history=2, window=4)
    n = len(synthetic.histories["u0"])
    assert [p for _, p in positions] == list(range(n - 6, n - 2))


def test_validation_targets_are_second_to_last_interactions(movielens: Any) -> None:
    users = UserSplit().training_users(movielens)
    requests = validation_requests(movielens, users, history=10, candidates=20, count=100, seed=1)
    assert len(requests) == 100 and len({r.user_id for r in requests}) == 100
    for request in requests:
        items = movielens.histories[request.user_id]
        assert request.target == items[-2]
        assert request.history == tuple(items[-12:-2])
        assert items[-1] not in request.candidates


def test_heldout_users_never_reach_training_or_validation(movielens: Any) -> None:
    split = UserSplit(heldout_fraction=0.2)
    train, heldout = split.training_users(movielens), split.heldout_users(movielens)
    assert not set(train) & set(heldout)
    assert set(train) | set(heldout) == set(movielens.histories)
    assert 0.15 < len(heldout) / len(movielens.histories) < 0.25
    requests = training_requests(movielens, train, 5, 10, 500, seed=0)
    assert not {r.user_id for r in requests} & set(heldout)
    assert set(split.heldout_dataset(movielens).histories) == set(heldout)


def test_the_user_split_is_stable_and_salted(synthetic: Dataset) -> None:
    a, b = UserSplit(0.5), UserSplit(0.5)
    assert a.heldout_users(synthetic) == b.heldout_users(synthetic)
    assert a.heldout_users(synthetic) != UserSplit(0.5, salt="other").heldout_users(synthetic)
    assert UserSplit(0.0).heldout_users(synthetic) == []


def test_requests_are_seeded_and_the_target_position_is_uniform(synthetic: Dataset) -> None:
    users = list(synthetic.histories)
    first = training_requests(synthetic, users, 3, 4, 10_000, seed=7)
    assert first == training_requests(synthetic, users, 3, 4, 10_000, seed=7)
    assert first != training_requests(synthetic, users, 3, 4, 10_000, seed=8)
    counts = Counter(r.target_index for r in first)
    assert set(counts) == {0, 1, 2, 3}
    assert max(counts.values()) / min(counts.values()) < 1.4  # position carries no signal


def test_bad_sizes_are_refused(synthetic: Dataset) -> None:
    with pytest.raises(ValueError, match="candidates"):
        training_requests(synthetic, ["u0"], 3, 1, 5)
    with pytest.raises(ValueError, match="history"):
        validation_requests(synthetic, ["u0"], 0, 4, 5)
    with pytest.raises(ValueError, match="heldout_fraction"):
        UserSplit(1.0)


def test_hard_negatives_are_the_retrieval_stages_items_for_the_shown_history(synthetic: Dataset) -> None:
    users = list(synthetic.histories)
    index = RetrievalIndex(synthetic.histories)
    uniform = training_requests(synthetic, users, 3, 9, 200, seed=5)
    half = training_requests(synthetic, users, 3, 9, 200, seed=5, hard=index.hard_negatives, hard_share=0.5)
    assert [(r.user_id, r.history, r.target) for r in half] == [(r.user_id, r.history, r.target) for r in uniform]
    assert half != uniform
    for request in half:
        seen = set(synthetic.histories[request.user_id])
        negatives = set(request.candidates) - {request.target}
        assert request.target in request.candidates and len(negatives) == 8
        assert not negatives & seen  # never an item the user interacted with, the target included
        assert set(index.hard_negatives(request.history, seen, 4)) <= negatives  # round(0.5 · 8) from the stage
    every = training_requests(synthetic, users, 3, 9, 50, seed=5, hard=index.hard_negatives, hard_share=1.0)
    assert all(set(r.candidates) - {r.target} == set(index.hard_negatives(r.history, synthetic.histories[r.user_id], 8))
               for r in every)
    with pytest.raises(ValueError, match="hard_share"):
        training_requests(synthetic, users, 3, 9, 5, hard=index.hard_negatives, hard_share=1.5)


def test_later_targets_are_the_users_next_items_and_never_reach_the_validation_target(movielens: Any) -> None:
    users = UserSplit().training_users(movielens)
    one = training_requests(movielens, users, history=10, candidates=20, count=500, seed=3, window=30)
    assert one == training_requests(movielens, users, 10, 20, 500, seed=3, window=30, positives=1)
    assert all(r.later_targets == () for r in one)
    five = training_requests(movielens, users, history=10, candidates=20, count=500, seed=3, window=30, positives=5)
    assert [(r.user_id, r.history, r.target) for r in five] == [(r.user_id, r.history, r.target) for r in one]
    assert sum(len(r.later_targets) for r in five) > 3 * len(five)  # most prompts get all four
    for request in five:
        items = movielens.histories[request.user_id]
        position = next(p for p in range(10, len(items) - 2)
                        if items[p] == request.target and tuple(items[p - 10:p]) == request.history)
        upcoming = [i for i in dict.fromkeys(items[position + 1:min(len(items) - 2, position + 5)])
                    if i != request.target]
        assert list(request.later_targets) == upcoming  # the next items, in order, the validation target never
        assert len(request.candidates) == len(set(request.candidates)) == 20
        assert {request.target, *request.later_targets} <= set(request.candidates)
        negatives = set(request.candidates) - {request.target, *request.later_targets}
        assert not negatives & set(items)  # the rest are items the user never saw
    with pytest.raises(ValueError, match="positives"):
        training_requests(movielens, users, 10, 20, 5, positives=20)
