"""`kvshard bench placement`: how long balanced clustering + assignment of N items takes, how much
memory it needs, and how many clusters move when one pod is added or removed, against the ideal 1/N.

Items are synthetic 384-d unit vectors around ``items / 1000`` topics (the shape of
all-MiniLM-L6-v2 embeddings of a catalog with themes), so the numbers measure the algorithm, not an
embedding model. They are written once, as float16, to a ``.npy`` file that the ``sampled``
method reads a chunk at a time (:mod:`kvshard_operator.placement_large`) — the operator's path for
large catalogs; ``full`` (:func:`kvshard_operator.placement.cluster_items`) loads them as one
float32 matrix. Writing the file is not timed: ``seconds`` covers what the operator does with a
vector file — reading it (float16 → unit float32; the file was just written, so from the page
cache), training, assigning, balancing — plus the first cluster → pod assignment; the ±1-pod
re-assignments are ``replace_seconds``.

``peak_rss_mb`` is the process's peak resident set so far (``getrusage``), so run ``sampled``
first (``--compare-full`` does): the ``full`` row's peak includes the ``sampled`` one.

``--vectors`` times what a bring-your-own-vectors catalog costs the operator end to end: the items
are written (not timed) as a JSONL catalog whose lines carry an ``embedding`` field, then read and
checked as the operator reads them (:func:`kvshard_operator.catalog_vectors.load`, ``from: Field``)
and placed by the sampled method; the row's method is ``vectors`` and ``seconds`` covers both.
Use a small ``--dim`` (64): the JSON text of 1 M × 384 numbers alone is ~2.7 GB.

Targets (issue 5): 1 M items on 100 pods in < 60 s, moved fraction ≤ 1.1 × ideal. Issue 19:
10 M items / 1,000 pods / 10,000 clusters in < 120 s and < 6 GB peak RSS, clusters max/mean ≤ 1.1,
and at 1 M items a mean cosine to the centroid within 5 % of ``full``.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

import kvshard_operator.catalog_vectors as catalog_vectors
import kvshard_operator.placement as placement
import kvshard_operator.placement_large as large
from kvshard_operator.vectors import ArrayVectors, NpyVectors, unit, write_npy

_GEN_CHUNK = 65536


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the options of ``kvshard bench placement``."""
    parser.add_argument("--items", type=int, default=1_000_000, help="synthetic items (default 1,000,000)")
    parser.add_argument("--pods", type=int, default=100, help="pods to place onto (default 100)")
    parser.add_argument("--clusters", type=int, default=1000, help="k of balanced k-means (default 1000)")
    parser.add_argument("--dim", type=int, default=384, help="embedding dimension (default 384)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--method", choices=("sampled", "full"), default="sampled",
                        help="sampled: two-level centroids trained on a sample, chunked assignment (the operator's "
                             "path for large catalogs); full: one float32 matrix (default sampled)")
    parser.add_argument("--compare-full", action="store_true",
                        help="also run the full method on the same items and report both mean cosines")
    parser.add_argument("--quality", action="store_true",
                        help="report each item's mean cosine to its cluster mean (two more passes over the items)")
    parser.add_argument("--vectors", action="store_true",
                        help="a catalog that carries its vectors (JSONL, embedding field): time reading and "
                             "checking it plus the sampled placement (method 'vectors'; use --dim 64)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where the float16 item file goes (default: a temporary folder, removed after)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    publish = parser.add_argument_group("--publish: what placement generations cost etcd (placement_publish)")
    publish.add_argument("--publish", action="store_true",
                         help="publish generations to a real etcd and measure bytes written and read, "
                              "content-addressed item maps next to the old per-generation layout")
    publish.add_argument("--rebalances", type=int, default=100, help="rebalance-only generations (default 100)")
    publish.add_argument("--catalog-changes", type=int, default=10,
                         help="generations re-labelling ~1%% of the items (default 10)")
    publish.add_argument("--moves", type=int, default=5, help="clusters moved per rebalance (default 5)")
    publish.add_argument("--change-fraction", type=float, default=0.01,
                         help="items re-labelled per catalog change (default 0.01)")


def synthetic_chunks(items: int, dim: int, seed: int) -> Iterator[np.ndarray]:
    """Unit vectors around ``max(16, items // 1000)`` topics, in chunks: topic + noise, where the noise
    is the sum of rows of two pools (cheap to draw, distinct per item)."""
    rng = np.random.default_rng(seed)
    topics = rng.standard_normal((max(16, items // 1000), dim), dtype=np.float32)
    pools = rng.standard_normal((2, 65536, dim), dtype=np.float32) * np.float32(0.7 / np.sqrt(2))
    for start in range(0, items, _GEN_CHUNK):
        count = min(_GEN_CHUNK, items - start)
        x = topics[rng.integers(0, len(topics), count)]
        x += pools[0][rng.integers(0, 65536, count)]
        x += pools[1][rng.integers(0, 65536, count)]
        yield unit(x).astype(np.float16)


def write_vector_catalog(path: Path, items: int, dim: int, seed: int) -> Path:
    """A JSONL catalog of ``items`` lines ``{"id", "text", "embedding"}`` (3 decimals, as exports have)."""
    with path.open("w", encoding="utf-8") as f:
        row = 0
        for chunk in synthetic_chunks(items, dim, seed):
            for vector in np.round(chunk.astype(np.float32), 3).tolist():
                f.write(json.dumps({"id": row, "text": f"item {row}", "embedding": vector}) + "\n")
                row += 1
    return path


def _vectors_row(folder: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    path = write_vector_catalog(folder / "items.jsonl", args.items, args.dim, args.seed)
    started = time.perf_counter()
    loaded = catalog_vectors.load({"file": {"path": str(path)}, "embeddings": {"from": "Field"}}, "bench")
    assert loaded.vectors is not None
    source = ArrayVectors(loaded.vectors)
    labels = large.cluster_large(source, args.clusters, seed=args.seed).labels
    seconds = time.perf_counter() - started
    score = large.mean_cosine(source, labels, int(labels.max()) + 1) if args.quality else None
    return _rows("vectors", labels, args, seconds, score)


def peak_rss_mb() -> float:
    """Peak resident set of this process so far, in MB (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _rows(method: str, labels: np.ndarray, args: argparse.Namespace, seconds: float,
          quality: float | None) -> list[dict[str, Any]]:
    capacity = {f"pod-{i:04d}": 1 << 34 for i in range(args.pods)}
    sizes = np.bincount(labels)
    clusters = [int(c) for c in np.flatnonzero(sizes)]
    t0 = time.perf_counter()
    base = placement.assign_clusters(clusters, capacity)
    seconds += time.perf_counter() - t0
    peak = peak_rss_mb()
    grown = dict(capacity, **{"pod-new": 1 << 34})
    shrunk = {p: b for p, b in capacity.items() if p != sorted(capacity)[args.pods // 2]}
    rows: list[dict[str, Any]] = []
    for change, pods in (("add", grown), ("remove", shrunk)):
        t0 = time.perf_counter()
        after = placement.assign_clusters(clusters, pods, previous=base)
        rows.append({
            "method": method,
            "change": change,
            "items": args.items,
            "pods": args.pods,
            "clusters": len(clusters),
            "seconds": round(seconds, 3),
            "replace_seconds": round(time.perf_counter() - t0, 4),
            "moved_fraction": placement.moved_replicas(base, after) / len(clusters),
            "ideal_fraction": 1 / max(len(pods), args.pods),
            "max_over_mean": round(float(sizes[sizes > 0].max() / sizes[sizes > 0].mean()), 4),
            "mean_cosine": None if quality is None else round(quality, 5),
            "peak_rss_mb": peak,
        })
    return rows


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the benchmark, print a table, write JSON if asked; returns one row per method and pod change
    (with ``--publish``: one row per etcd layout, :mod:`kvshard_bench.placement_publish`)."""
    if getattr(args, "publish", False):
        from kvshard_bench import placement_publish

        published = placement_publish.run_publish(args)
        placement_publish.print_rows(published)
        if args.json is not None:
            args.json.write_text(json.dumps(published, indent=2) + "\n")
        return published
    with tempfile.TemporaryDirectory(dir=args.data_dir) as folder:
        if getattr(args, "vectors", False):
            given = _vectors_row(Path(folder), args)
            _print(given, args)
            return given
        path = write_npy(Path(folder) / "items.npy", synthetic_chunks(args.items, args.dim, args.seed),
                         args.items, args.dim)
        source = NpyVectors(path)
        methods = ["sampled", "full"] if args.compare_full else [args.method]
        quality = args.quality or args.compare_full
        rows: list[dict[str, Any]] = []
        for method in methods:
            started = time.perf_counter()
            if method == "sampled":
                labels: np.ndarray = large.cluster_large(source, args.clusters, seed=args.seed).labels
            else:
                labels = placement.cluster_items(np.load(path).astype(np.float32), args.clusters, seed=args.seed)
            seconds = time.perf_counter() - started
            score = large.mean_cosine(source, labels, int(labels.max()) + 1) if quality else None
            rows += _rows(method, labels, args, seconds, score)
    _print(rows, args)
    return rows


def _print(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"{'method':<9}{'change':<8}{'items':>10}{'pods':>6}{'clusters':>10}{'seconds':>9}{'moved':>9}"
          f"{'ideal':>9}{'ratio':>7}{'max/mean':>9}{'cosine':>9}{'peak MB':>9}")
    for row in rows:
        ratio = row["moved_fraction"] / row["ideal_fraction"]
        cosine = "-" if row["mean_cosine"] is None else f"{row['mean_cosine']:.4f}"
        print(f"{row['method']:<9}{row['change']:<8}{row['items']:>10}{row['pods']:>6}{row['clusters']:>10}"
              f"{row['seconds']:>9.2f}{row['moved_fraction']:>9.4f}{row['ideal_fraction']:>9.4f}{ratio:>7.2f}"
              f"{row['max_over_mean']:>9.3f}{cosine:>9}{row['peak_rss_mb']:>9.0f}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
