"""`kvshard bench placement`: how long balanced clustering + assignment of N items takes, and how
many clusters move when one pod is added or removed, against the ideal 1/N.

Items are random unit vectors (the shape of all-MiniLM-L6-v2 embeddings, 384-d), so the numbers
measure the algorithm, not an embedding model. Targets (issue 5): 1 M items on 100 pods in < 60 s,
moved fraction ≤ 1.1 × ideal.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

import kvshard_operator.placement as placement


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the options of ``kvshard bench placement``."""
    parser.add_argument("--items", type=int, default=1_000_000, help="synthetic items (default 1,000,000)")
    parser.add_argument("--pods", type=int, default=100, help="pods to place onto (default 100)")
    parser.add_argument("--clusters", type=int, default=1000, help="k of balanced k-means (default 1000)")
    parser.add_argument("--dim", type=int, default=384, help="embedding dimension (default 384)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the benchmark, print a table, write JSON if asked; returns one row per pod change."""
    rng = np.random.default_rng(args.seed)
    vectors = placement.normalise(rng.standard_normal((args.items, args.dim), dtype=np.float32))
    capacity = {f"pod-{i:04d}": 1 << 34 for i in range(args.pods)}

    started = time.perf_counter()
    labels = placement.cluster_items(vectors, args.clusters, seed=args.seed)
    clusters = sorted({int(c) for c in np.unique(labels)})
    base = placement.assign_clusters(clusters, capacity)
    seconds = time.perf_counter() - started

    grown = dict(capacity, **{"pod-new": 1 << 34})
    shrunk = {p: b for p, b in capacity.items() if p != sorted(capacity)[args.pods // 2]}
    rows: list[dict[str, Any]] = []
    for change, pods in (("add", grown), ("remove", shrunk)):
        t0 = time.perf_counter()
        after = placement.assign_clusters(clusters, pods, previous=base)
        rows.append({
            "change": change,
            "items": args.items,
            "pods": args.pods,
            "clusters": len(clusters),
            "seconds": round(seconds, 3),
            "replace_seconds": round(time.perf_counter() - t0, 4),
            "moved_fraction": placement.moved_replicas(base, after) / len(clusters),
            "ideal_fraction": 1 / max(len(pods), args.pods),
        })

    print(f"{'change':<8}{'items':>10}{'pods':>6}{'clusters':>10}{'seconds':>9}{'moved':>9}{'ideal':>9}{'ratio':>7}")
    for row in rows:
        ratio = row["moved_fraction"] / row["ideal_fraction"]
        print(f"{row['change']:<8}{row['items']:>10}{row['pods']:>6}{row['clusters']:>10}{row['seconds']:>9.2f}"
              f"{row['moved_fraction']:>9.4f}{row['ideal_fraction']:>9.4f}{ratio:>7.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows
