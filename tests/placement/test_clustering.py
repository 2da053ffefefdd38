"""Balanced k-means: deterministic, balanced, and it keeps similar items together."""

from __future__ import annotations

import numpy as np

from kvshard_operator import placement


def blobs(n_per: int, centres: int, dim: int = 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    means = placement.normalise(rng.standard_normal((centres, dim)))
    truth = np.repeat(np.arange(centres), n_per)
    x = means[truth] + 0.05 * rng.standard_normal((len(truth), dim)).astype(np.float32)
    return placement.normalise(x), truth


def test_same_inputs_and_seed_give_the_same_labels() -> None:
    x, _ = blobs(50, 8)
    a = placement.cluster_items(x, 8, seed=3)
    b = placement.cluster_items(x.copy(), 8, seed=3)
    assert np.array_equal(a, b)


def test_no_cluster_exceeds_the_balance_cap() -> None:
    rng = np.random.default_rng(1)
    # a skewed catalog: one dense region holds half of the items
    x = np.concatenate([rng.standard_normal((1000, 8)), 0.01 * rng.standard_normal((1000, 8)) + 5])
    labels = placement.cluster_items(x, 10, slack_percent=10)
    sizes = np.bincount(labels, minlength=10)
    assert sizes.max() <= int(np.ceil(1.1 * 2000 / 10))
    assert sizes.sum() == 2000


def test_well_separated_groups_end_up_in_pure_clusters() -> None:
    x, truth = blobs(100, 5)
    labels = placement.cluster_items(x, 5, seed=0)
    for c in range(5):
        members = truth[labels == c]
        assert np.bincount(members).max() / len(members) >= 0.95


def test_more_clusters_than_items_gives_one_item_per_cluster() -> None:
    x, _ = blobs(1, 3)
    labels = placement.cluster_items(x, 10)
    assert sorted(labels.tolist()) == [0, 1, 2]


def test_cooccurrence_pull_brings_items_of_one_history_closer() -> None:
    rng = np.random.default_rng(0)
    x = placement.normalise(rng.standard_normal((6, 32)))
    pulled = placement.pull_cooccurring(x, [[0, 1], [0, 1, 2]], percent=50)
    before = float(x[0] @ x[1])
    after = float(pulled[0] @ pulled[1])
    assert after > before
    assert np.allclose(pulled[5], x[5]), "items never seen together stay where they are"


def test_cooccurrence_pull_of_zero_percent_changes_nothing() -> None:
    x = placement.normalise(np.eye(4, dtype=np.float32) + 0.1)
    assert np.allclose(placement.pull_cooccurring(x, [[0, 1, 2, 3]], percent=0), x)
