"""Placement from sampled centroids (issue 19): capacity and balance hold, quality stays close to the
full balanced k-means, vectors are read in chunks from float16 files, and later catalog changes
reuse the same centroids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvshard.catalog_schema import Catalog
from kvshard_bench.placement import synthetic_chunks
from kvshard_operator import catalog_update, placement
from kvshard_operator import placement_large as large
from kvshard_operator.vectors import ArrayVectors, NpyVectors, write_npy


def _items(n: int, dim: int = 48, seed: int = 3) -> np.ndarray:
    return np.concatenate(list(synthetic_chunks(n, dim, seed)))


def test_sampled_placement_respects_capacity_and_labels_every_item() -> None:
    x = _items(30_000)
    result = large.cluster_large(ArrayVectors(x), 300, seed=1, slack_percent=10)
    sizes = result.sizes
    assert len(result.labels) == len(x) and result.labels.min() >= 0
    assert result.cap == -(-30_000 * 110 // (100 * 300))
    assert sizes.max() <= result.cap
    assert sizes.max() / sizes.mean() <= 1.1 + 1e-9
    assert (sizes > 0).all()


def test_sampled_placement_is_deterministic_for_a_seed() -> None:
    source = ArrayVectors(_items(8_000))
    a = large.cluster_large(source, 80, seed=7).labels
    b = large.cluster_large(source, 80, seed=7).labels
    assert np.array_equal(a, b)


def test_sampled_quality_is_within_five_percent_of_full_balanced_kmeans() -> None:
    x = _items(40_000, dim=64)
    source = ArrayVectors(x)
    sampled = large.cluster_large(source, 400, seed=0).labels
    full = placement.cluster_items(x.astype(np.float32), 400, seed=0)
    q_sampled = large.mean_cosine(source, sampled, 400)
    q_full = large.mean_cosine(source, full, 400)
    assert q_sampled >= 0.95 * q_full, (q_sampled, q_full)
    # and it is a real clustering, far better than random labels
    rng = np.random.default_rng(0)
    assert q_sampled > 1.5 * large.mean_cosine(source, rng.integers(0, 400, len(x)), 400)


def test_float16_file_is_read_in_chunks_like_the_array(tmp_path: Path) -> None:
    x = _items(5_000, dim=32)
    path = write_npy(tmp_path / "v.npy", (x[i:i + 999] for i in range(0, len(x), 999)), len(x), 32)
    source = NpyVectors(path)
    assert (source.rows, source.dim) == (5_000, 32)
    assert np.allclose(source.read(100, 300), ArrayVectors(x).read(100, 300), atol=1e-6)
    rows = np.array([4999, 3, 4, 5, 17, 2])
    assert np.allclose(source.take(rows), ArrayVectors(x).take(rows), atol=1e-6)
    from_file = large.cluster_large(source, 50, seed=2).labels
    from_array = large.cluster_large(ArrayVectors(x), 50, seed=2).labels
    assert np.array_equal(from_file, from_array)


def test_write_npy_refuses_a_short_stream(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="announced"):
        write_npy(tmp_path / "v.npy", [np.zeros((3, 4))], 5, 4)
    assert not (tmp_path / "v.npy").exists()


def test_catalog_changes_reuse_the_sampled_centroids() -> None:
    x = _items(6_000, dim=32).astype(np.float32)
    result = large.cluster_large(ArrayVectors(x), 60, seed=0)
    ids = tuple(f"i{i}" for i in range(len(x)))
    old = Catalog(ids, tuple(f"text {i}" for i in range(len(x))))
    new = Catalog(ids + ("new",), old.texts + ("text new",))
    labels = {item: int(c) for item, c in zip(ids, result.labels, strict=True)}
    target = 17
    centre = result.codebook.fine[target]
    centroids = result.update_centroids()
    assert centroids.counts.sum() == len(x)
    update = catalog_update.apply_change(old, new, labels, centroids, lambda texts: centre[None, :].copy())
    assert update.labels["new"] == target
    assert update.moved_unchanged == 0


def _reference_candidates(x: np.ndarray, book: large.Codebook, probes: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Brute force: every fine cluster of each row's ``probes`` nearest groups, the ``m`` best."""
    coarse = x @ book.coarse.T
    fine = x @ book.fine.T
    groups = np.argsort(-coarse, axis=1, kind="stable")[:, :probes]
    allowed = (book.group[None, :, None] == groups[:, None, :]).any(axis=2)
    fine = np.where(allowed, fine, -np.inf)
    best = np.argsort(-fine, axis=1, kind="stable")[:, :m]
    return best, np.take_along_axis(fine, best, axis=1)


@pytest.mark.parametrize("probes,m", [(1, 1), (3, 4), (4, 1), (20, 3)])
def test_two_pass_search_finds_the_exact_best_clusters_of_the_probed_groups(probes: int, m: int) -> None:
    x = _items(6_000, dim=32).astype(np.float32)
    book = large.train(ArrayVectors(x), 120, seed=4, refine=1)
    cand, score = large._candidates(lambda a, b: x[a:b], len(x), large._Router.of(book, probes), m)
    ref_cand, ref_score = _reference_candidates(x, book, min(probes, len(book.members)), m)
    assert np.allclose(score, ref_score, atol=1e-5)
    assert (cand == ref_cand).mean() > 0.999  # only float rounding may swap near-equal neighbours


def test_zero_and_duplicate_rows_get_exactly_their_candidates() -> None:
    x = _items(3_000, dim=32).astype(np.float32)
    x[:50] = 0.0  # ties everywhere
    x[50:100] = x[100]  # duplicates
    book = large.train(ArrayVectors(x), 60, seed=1, refine=1)
    cand, score = large._candidates(lambda a, b: x[a:b], len(x), large._Router.of(book, 4), 4)
    assert (cand >= 0).all() and len(np.unique(cand[0])) == 4 and (score[:50] == 0).all()
    assert (cand[50:100] == cand[100]).all()
    result = large.assign(ArrayVectors(x), book)
    assert result.labels.min() >= 0 and result.sizes.max() <= result.cap


def _reference_capacity(cand: np.ndarray, score: np.ndarray, cap: int, k: int) -> np.ndarray:
    labels = np.full(len(cand), -1, dtype=np.int32)
    remaining = np.full(k, cap)
    for r in range(cand.shape[1]):
        idx = np.flatnonzero(labels < 0)
        c, s = cand[idx, r].astype(np.int64), score[idx, r]
        valid = (c >= 0) & (remaining[np.maximum(c, 0)] > 0)
        idx, c, s = idx[valid], c[valid], s[valid]
        order = np.lexsort((idx, -s, c))
        idx, c = idx[order], c[order]
        ok = np.arange(len(c)) - np.searchsorted(c, c, side="left") < remaining[c]
        labels[idx[ok]] = c[ok]
        remaining -= np.bincount(c[ok], minlength=k)
    return labels


@pytest.mark.parametrize("trial", range(12))
def test_capacity_bounded_takes_better_scores_then_lower_rows(trial: int) -> None:
    rng = np.random.default_rng(trial)
    n, k, m = int(rng.integers(1, 2_000)), int(rng.integers(1, 40)), int(rng.integers(1, 5))
    cand = rng.integers(-1 if trial % 3 == 0 else 0, k, (n, m)).astype(np.int32)
    score = rng.integers(-2, 3, (n, m)).astype(np.float32) * np.float32(0.25)  # many ties, ±0.0
    score[rng.random((n, m)) < 0.1] = -0.0
    cap = int(rng.integers(1, max(2, 2 * n // k)))
    assert np.array_equal(large.capacity_bounded(cand, score, cap, k), _reference_capacity(cand, score, cap, k))


def test_take_reads_runs_duplicates_and_nothing(tmp_path: Path) -> None:
    x = _items(3_000, dim=16)
    source = NpyVectors(write_npy(tmp_path / "v.npy", [x], len(x), 16))
    rows = np.array([2999, 7, 8, 9, 9, 0, 1500, 1501, 7])
    assert np.allclose(source.take(rows), ArrayVectors(x).take(rows), atol=1e-6)
    assert source.take(np.array([], dtype=np.int64)).shape == (0, 16)
    assert source.read(2990, 5000).shape == (10, 16)
    with pytest.raises(IndexError):
        source.take(np.array([3000]))
