"""`kvshard bench catalog`: a catalog change applied as a diff, timed from "change seen" to "new
generation published" in a real etcd, with the items that moved although they did not change.

The catalog is synthetic: item ``i`` reads "<adjective> <material> <product> for <audience>, model
<i>" with the four words drawn (seeded) from small vocabularies, so texts are short, uniform and
cluster by topic like a shop's. The change is the issue's: +1 % new items, 0.5 % edited (a new
adjective and audience), 0.5 % removed, drawn with the same seed.

Two rows, side by side: ``initial`` (embed, cluster and publish the whole catalog: the baseline a
re-clustering would pay on every change) and ``change`` (diff, embed only the new and edited items,
nearest-cluster assignment, publish the catalog version and one generation). ``--embedder hashed``
(the default) embeds with a feature-hashing bag of words (384-d, deterministic, microseconds per
item), so a 100,000-item run measures the diff and publish machinery in seconds on a small machine;
``--embedder minilm`` uses the operator's real all-MiniLM-L6-v2 (about 10–15 ms per item on one
busy CPU core: use it with fewer items). ``embed_seconds`` says how much of each row was embedding.
``operator_peak_mb`` is the peak of Python allocations (tracemalloc, numpy included) during the
step — measured on a second, untimed run of the change, because tracemalloc slows every allocation
and would inflate ``publish_seconds``; ``rss_peak_mb`` the process's peak resident memory so far.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import resource
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvshard import placement_schema as ps
from kvshard.catalog_schema import Catalog, diff
from kvshard_local.testing_servers import EtcdServer
from kvshard_operator import catalog_update as updates
from kvshard_operator import placement

ADJECTIVES = ("light", "heavy", "vintage", "modern", "compact", "rugged", "elegant", "cheap", "premium", "classic")
MATERIALS = ("leather", "steel", "cotton", "oak", "glass", "wool", "carbon", "ceramic", "bamboo", "linen")
PRODUCTS = ("backpack", "kettle", "jacket", "desk", "lamp", "bicycle", "headphones", "teapot", "sofa", "watch",
            "tent", "blender", "scarf", "chair", "camera", "notebook")
AUDIENCES = ("kids", "runners", "students", "chefs", "travellers", "gamers", "gardeners", "office workers")
DIM = 384
COLUMNS = ("scenario", "items", "added", "edited", "removed", "publish_seconds", "moved_unchanged_items",
           "diff_seconds", "embed_seconds", "operator_peak_mb", "rss_peak_mb", "catalog_bytes", "clusters")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the options of ``kvshard bench catalog``."""
    parser.add_argument("--items", type=int, default=100_000, help="synthetic catalog size (default 100,000)")
    parser.add_argument("--clusters", type=int, default=100, help="k of the clustering (default 100)")
    parser.add_argument("--pods", type=int, default=3, help="pods the clusters are assigned to (default 3)")
    parser.add_argument("--added-percent", type=float, default=1.0, help="new items, %% of the catalog (default 1)")
    parser.add_argument("--edited-percent", type=float, default=0.5, help="edited items, %% (default 0.5)")
    parser.add_argument("--removed-percent", type=float, default=0.5, help="removed items, %% (default 0.5)")
    parser.add_argument("--embedder", choices=("hashed", "minilm"), default="hashed",
                        help="hashed: a fast feature-hashing stand-in (default); minilm: the operator's real model")
    parser.add_argument("--seed", type=int, default=0, help="seed of the catalog and the change (default 0)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")


def item_text(rng: random.Random, i: int) -> str:
    return (f"{rng.choice(ADJECTIVES)} {rng.choice(MATERIALS)} {rng.choice(PRODUCTS)} for "
            f"{rng.choice(AUDIENCES)}, model {i}")


def synthetic(items: int, seed: int) -> Catalog:
    rng = random.Random(seed)
    return Catalog(tuple(f"item-{i:07d}" for i in range(items)), tuple(item_text(rng, i) for i in range(items)))


def changed(base: Catalog, added: int, edited: int, removed: int, seed: int) -> Catalog:
    rng = random.Random(seed + 1)
    rows = list(range(len(base)))
    picked = rng.sample(rows, edited + removed)
    edit, drop = set(picked[:edited]), set(picked[edited:])
    ids: list[str] = []
    texts: list[str] = []
    for row in rows:
        if row in drop:
            continue
        ids.append(base.ids[row])
        texts.append(item_text(rng, row) + " (revised)" if row in edit else base.texts[row])
    for n in range(added):
        ids.append(f"new-{n:07d}")
        texts.append(item_text(rng, len(base) + n))
    return Catalog(tuple(ids), tuple(texts))


def hashed_embed(texts: Sequence[str]) -> updates.FloatArray:
    """Feature hashing of words and word pairs into 384 signed dimensions, unit length."""
    out = np.zeros((len(texts), DIM), dtype=np.float32)
    for row, text in enumerate(texts):
        words = text.lower().replace(",", " ").split()
        for token in [*words, *(a + "_" + b for a, b in zip(words, words[1:], strict=False))]:
            digest = hashlib.blake2b(token.encode(), digest_size=4).digest()
            value = int.from_bytes(digest, "little")
            out[row, value % DIM] += 1.0 if value & (1 << 31) else -1.0
    out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out


def _embedder(name: str) -> updates.Embed:
    if name == "hashed":
        return hashed_embed
    from kvshard_operator import embedding

    return embedding.embed_texts


async def _publish(server: EtcdServer, cat: Catalog, labels: dict[str, int], pods: int, generation: int,
                   previous: ps.Placement | None, name: str = "catalog") -> tuple[ps.Placement, int]:
    clusters = sorted(set(labels.values()))
    capacities = {f"engine-{p}": 1 << 40 for p in range(pods)}
    assignment = placement.assign_clusters(clusters, capacities,
                                           previous=previous.assignment if previous else None)
    new = ps.Placement(generation, {c: tuple(h) for c, h in assignment.items()}, labels, pods=tuple(capacities),
                       model="bench", catalog=cat.version)
    async with server.store(timeout=30) as store:
        written = await store.put_catalog("bench", name, cat)
        await store.publish("bench", name, new, expected=generation - 1)
    return new, written


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run both scenarios against a real etcd; print a table, write JSON if asked."""
    embed = _embedder(args.embedder)
    base = synthetic(args.items, args.seed)
    added = round(args.items * args.added_percent / 100)
    edited = round(args.items * args.edited_percent / 100)
    removed = round(args.items * args.removed_percent / 100)
    rows: list[dict[str, Any]] = []
    with EtcdServer() as server:
        tracemalloc.start()
        started = time.perf_counter()
        vectors = embed(base.texts)
        embed_s = time.perf_counter() - started
        labels_array = placement.cluster_items(vectors, args.clusters, seed=args.seed)
        labels = {item: int(c) for item, c in zip(base.ids, labels_array, strict=True)}
        centroids = updates.Centroids.from_vectors(vectors, [int(c) for c in labels_array], args.clusters)
        cluster_s = time.perf_counter() - started
        del vectors
        first, written = asyncio.run(_publish(server, base, labels, args.pods, 1, None))
        rows.append({"scenario": "initial", "items": len(base), "added": len(base), "edited": 0, "removed": 0,
                     "publish_seconds": round(time.perf_counter() - started, 3), "moved_unchanged_items": 0,
                     "diff_seconds": round(cluster_s, 3), "embed_seconds": round(embed_s, 3),
                     "operator_peak_mb": round(tracemalloc.get_traced_memory()[1] / 2**20, 1),
                     "rss_peak_mb": round(_rss_mb(), 1), "catalog_bytes": written, "clusters": args.clusters})
        tracemalloc.reset_peak()

        tracemalloc.stop()

        new = changed(base, added, edited, removed, args.seed)  # the change is "seen" once it is parsed
        timed_embed = _Timed(embed)
        started = time.perf_counter()  # timed without tracemalloc, which slows every allocation
        update = updates.apply_change(base, new, labels, centroids, timed_embed)
        diff_s = time.perf_counter() - started
        second, written = asyncio.run(_publish(server, new, update.labels, args.pods, 2, first))
        publish_s = time.perf_counter() - started
        tracemalloc.start()  # the same step again, untimed, for its memory (published under another name)
        again = updates.apply_change(base, new, labels, centroids, embed)
        asyncio.run(_publish(server, new, again.labels, args.pods, 1, None, name="catalog-memory"))
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        change = diff(base, new)
        untouched = set(base.ids) - set(change.edited) - set(change.removed)
        moved = sum(1 for item in untouched if first.item_clusters[item] != second.item_clusters[item])
        assert moved == update.moved_unchanged
        rows.append({"scenario": "change", "items": len(new), "added": len(change.added),
                     "edited": len(change.edited), "removed": len(change.removed),
                     "publish_seconds": round(publish_s, 3), "moved_unchanged_items": moved,
                     "diff_seconds": round(diff_s, 3), "embed_seconds": round(timed_embed.seconds, 3),
                     "operator_peak_mb": round(peak, 1), "rss_peak_mb": round(_rss_mb(), 1),
                     "catalog_bytes": written, "clusters": args.clusters})
    for row in rows:
        row["embedder"] = args.embedder
    _print(rows)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


class _Timed:
    """An embedder that adds up the time it spends."""

    def __init__(self, embed: updates.Embed) -> None:
        self._embed = embed
        self.seconds = 0.0

    def __call__(self, texts: Sequence[str]) -> updates.FloatArray:
        started = time.perf_counter()
        try:
            return self._embed(texts)
        finally:
            self.seconds += time.perf_counter() - started


def _print(rows: list[dict[str, Any]]) -> None:
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in COLUMNS}
    print("  ".join(c.ljust(widths[c]) for c in COLUMNS))
    for row in rows:
        print("  ".join(str(row[c]).ljust(widths[c]) for c in COLUMNS))
