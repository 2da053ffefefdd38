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
