"""Catalog changes without re-clustering: new and edited items go to the nearest existing cluster.

A catalog is never finished: items are added and edited every hour. Re-clustering on each change
would move items between clusters, and every moved item is a block that goes cold on its old pod
and must be warmed on a new one. So a change is applied as a diff (:func:`kvshard.catalog_schema.diff`):

* an unchanged item keeps its cluster — always: this is what "0 moved" in ``kvshard bench
  catalog`` measures;
* an added item is embedded and joins the cluster whose centroid is nearest (cosine), among the
  clusters still below the balance cap (``n/k · (1 + slack)``, as balanced k-means allows); when
  every cluster is full, the nearest one;
* an edited item (new text, hence a new block key anyway) is re-embedded and placed the same way;
  it stays where it was when that cluster is still its nearest;
* a removed item is dropped.

Centroids are kept as per-cluster *sums* of unit vectors and counts (``k × 384`` floats, never
``n × 384``), updated by each change; a removed item is not subtracted (its old vector is not
kept), so a centroid remembers removed items until the next full clustering — it only steers where
new items go. After an operator restart the sums are rebuilt from a sample of each cluster's
members (:data:`CENTROID_SAMPLE`), not the whole catalog.

:func:`imbalance` (largest cluster over the mean) is the drift measure reported in the status.
A full re-clustering happens when ``spec.clusters`` changes, and when a change leaves the clusters
drifted past ``Settings.recluster_imbalance_percent`` (:func:`drifted`): then the whole new catalog
is clustered afresh by the same balanced k-means as the first placement, and the fresh cluster ids
are matched to the old ones (:func:`match_clusters`, greedy on the overlap of unchanged items) so
that most items keep their cluster id, hence their pods; only the items the rebalancing itself
forces out of an overfull cluster move (:func:`recluster`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from kvshard.catalog_schema import Catalog, CatalogDiff, diff
from kvshard_operator.vectors import VectorSource

FloatArray = npt.NDArray[np.float32]
Embed = Callable[[Sequence[str]], FloatArray]
"""Texts → unit vectors, one row each."""

CENTROID_SAMPLE = 32
"""Members per cluster embedded to rebuild centroids after a restart."""


@dataclasses.dataclass
class Centroids:
    """Per-cluster sums of member vectors and member counts."""

    sums: FloatArray
    counts: npt.NDArray[np.int64]

    @classmethod
    def from_vectors(cls, vectors: FloatArray, labels: Sequence[int], k: int) -> Centroids:
        sums = np.zeros((k, vectors.shape[1]), dtype=np.float32)
        np.add.at(sums, np.asarray(labels, dtype=np.int64), vectors)
        counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=k).astype(np.int64)
        return cls(sums, counts)

    @property
    def k(self) -> int:
        return int(self.sums.shape[0])

    def unit(self) -> FloatArray:
        norms = np.linalg.norm(self.sums, axis=1, keepdims=True)
        out: FloatArray = (self.sums / np.maximum(norms, 1e-12)).astype(np.float32)
        return out

    def add(self, cluster: int, vector: FloatArray) -> None:
        self.sums[cluster] += vector
        self.counts[cluster] += 1

    def relabel(self, mapping: npt.NDArray[np.int64]) -> Centroids:
        """These centroids under new ids: cluster ``c`` becomes ``mapping[c]``."""
        sums, counts = np.zeros_like(self.sums), np.zeros_like(self.counts)
        sums[mapping], counts[mapping] = self.sums, self.counts
        return Centroids(sums, counts)


@dataclasses.dataclass(frozen=True)
class Update:
    """The result of one catalog change."""

    labels: dict[str, int]
    diff: CatalogDiff
    reassigned: tuple[str, ...]
    """Edited items whose cluster changed."""
    moved_unchanged: int
    """Unchanged items whose cluster changed (0 by construction unless re-clustered; measured, not assumed)."""
    reclustered: bool = False
    """The diff drifted past the threshold, so the whole catalog was clustered afresh (:func:`recluster`)."""
    drift: float = 1.0
    """:func:`imbalance` of the diff's labels, before any re-clustering."""


def sample_centroids(catalog: Catalog, labels: Mapping[str, int], k: int, embed: Embed,
                     sample: int = CENTROID_SAMPLE, seed: int = 0, source: VectorSource | None = None) -> Centroids:
    """Centroids from at most ``sample`` members of each cluster (after a restart). ``source`` holds
    the catalog's own vectors (row ``i`` is item ``i``) when they were given; then nothing is embedded."""
    members: dict[int, list[int]] = {}
    for row, item_id in enumerate(catalog.ids):
        cluster = labels.get(item_id)
        if cluster is not None and 0 <= cluster < k:
            members.setdefault(cluster, []).append(row)
    rng = random.Random(seed)
    rows: list[int] = []
    for cluster in sorted(members):
        chosen = members[cluster]
        rows += chosen if len(chosen) <= sample else rng.sample(chosen, sample)
    if not rows:
        return Centroids(np.zeros((k, 1), dtype=np.float32), np.zeros(k, dtype=np.int64))
    vectors = (embed([item_line(catalog, r) for r in rows]) if source is None
               else source.take(np.asarray(rows, dtype=np.int64)))
    return Centroids.from_vectors(vectors, [labels[catalog.ids[r]] for r in rows], k)


def item_line(catalog: Catalog, row: int) -> str:
    """What is embedded for an item: its text (fields are presentation, not meaning)."""
    return catalog.texts[row]


def apply_change(old: Catalog, new: Catalog, labels: Mapping[str, int], centroids: Centroids, embed: Embed,
                 *, slack_percent: int = 10, source: VectorSource | None = None) -> Update:
    """New labels for ``new`` given ``old``'s ``labels``; updates ``centroids`` in place. ``source``
    holds ``new``'s given vectors (row ``i`` is item ``i``): new and edited items are read from it,
    not embedded."""
    change = diff(old, new)
    out = {item_id: labels[item_id] for item_id in new.ids if item_id in labels}
    for item_id in change.removed:
        out.pop(item_id, None)
    k = centroids.k
    sizes = np.bincount(np.fromiter((c for c in out.values() if 0 <= c < k), dtype=np.int64), minlength=k)
    for item_id in change.edited:
        sizes[out[item_id]] -= 1
    cap = int(np.ceil(len(new) / max(k, 1) * (1 + slack_percent / 100)))
    todo = [*change.edited, *change.added]
    reassigned: list[str] = []
    if todo:
        row = {item_id: i for i, item_id in enumerate(new.ids)}
        vectors = (embed([item_line(new, row[item_id]) for item_id in todo]) if source is None
                   else source.take(np.fromiter((row[i] for i in todo), dtype=np.int64, count=len(todo))))
        if centroids.sums.shape[1] != vectors.shape[1]:
            centroids.sums = np.zeros((k, vectors.shape[1]), dtype=np.float32)
        # one matmul against the centroids as they were before this change: a change is small next to
        # the clusters it joins, so updating the centroids item by item would only cost time
        similarities = (vectors @ centroids.unit().T if centroids.counts.any()
                        else np.zeros((len(todo), k), dtype=np.float32))
        for item_id, vector, similarity in zip(todo, vectors, similarities, strict=True):
            # the nearest cluster still below the cap (argmax keeps the lowest index among ties, as a
            # stable sort would); the nearest of all when every cluster is full
            open_ = sizes < cap
            cluster = int(np.argmax(np.where(open_, similarity, -np.inf))) if open_.any() \
                else int(np.argmax(similarity))
            if item_id in labels and labels[item_id] != cluster:
                reassigned.append(item_id)
            out[item_id] = cluster
            sizes[cluster] += 1
            centroids.add(cluster, vector)
    untouched = set(change.added) | set(change.edited)
    moved = sum(1 for item_id, c in out.items() if item_id not in untouched and labels.get(item_id) != c)
    ordered = {item_id: out[item_id] for item_id in new.ids}
    return Update(ordered, change, tuple(reassigned), moved)


def imbalance(labels: Mapping[str, int]) -> float:
    """Largest cluster over the mean cluster size (1.0 = perfectly even)."""
    if not labels:
        return 1.0
    counts = np.bincount(np.fromiter(labels.values(), dtype=np.int64))
    counts = counts[counts > 0]
    return float(counts.max() / counts.mean())


def drifted(labels: Mapping[str, int], threshold_percent: int) -> bool:
    """Whether ``labels`` have drifted past ``threshold_percent`` (largest cluster over the mean, as
    ``status.catalog.imbalancePercent``); a threshold of 0 never re-clusters."""
    return threshold_percent > 0 and imbalance(labels) * 100 > threshold_percent


def match_clusters(kept: Mapping[str, int], fresh: Mapping[str, int], k: int) -> npt.NDArray[np.int64]:
    """``mapping[f]`` = the old id fresh cluster ``f`` takes, so that as many ``kept`` items (item → old
    cluster: the ones whose blocks are warm somewhere) as possible keep their id. Greedy on the k × k
    overlap matrix, largest overlap first (one pass over k² pairs; within a few items of the optimal
    assignment when clusters are large, and scipy is not an operator dependency); fresh clusters
    left over take the unused old ids in order."""
    size = max(k, max(fresh.values(), default=-1) + 1, max(kept.values(), default=-1) + 1)
    overlap = np.zeros((size, size), dtype=np.int64)
    for item_id, cluster in fresh.items():
        old = kept.get(item_id)
        if old is not None and old >= 0:
            overlap[cluster, old] += 1
    mapping = np.full(size, -1, dtype=np.int64)
    taken = np.zeros(size, dtype=bool)
    for flat in np.argsort(-overlap, axis=None, kind="stable"):
        f, o = divmod(int(flat), size)
        if overlap[f, o] == 0:
            break
        if mapping[f] < 0 and not taken[o]:
            mapping[f], taken[o] = o, True
    free = iter(np.flatnonzero(~taken).tolist())
    for f in np.flatnonzero(mapping < 0).tolist():
        mapping[f] = next(free)
    return mapping


def recluster(update: Update, previous: Mapping[str, int], fresh: Mapping[str, int],
              k: int) -> tuple[Update, npt.NDArray[np.int64]]:
    """``update`` with its labels replaced by a fresh clustering of the whole new catalog, whose ids
    are matched (:func:`match_clusters`) to ``previous`` over the unchanged items; also the id mapping
    (to relabel the fresh centroids). ``moved_unchanged`` counts the unchanged items that moved."""
    changed = set(update.diff.added) | set(update.diff.edited)
    kept = {item_id: previous[item_id] for item_id in update.labels if item_id in previous and item_id not in changed}
    mapping = match_clusters(kept, fresh, k)
    labels = {item_id: int(mapping[fresh[item_id]]) for item_id in update.labels}
    moved = sum(1 for item_id, old in kept.items() if labels[item_id] != old)
    reassigned = tuple(i for i in update.diff.edited if i in previous and labels.get(i) != previous[i])
    return dataclasses.replace(update, labels=labels, reassigned=reassigned, moved_unchanged=moved,
                               reclustered=True), mapping


def forced_moves(labels: Mapping[str, int], k: int, slack_percent: int) -> int:
    """Items that must leave their cluster for every cluster to fit the balance cap
    (``ceil(n/k · (1 + slack))``): the least any re-clustering of ``labels`` can move."""
    if not labels:
        return 0
    sizes = np.bincount(np.fromiter(labels.values(), dtype=np.int64), minlength=k)
    cap = int(np.ceil(len(labels) / max(k, 1) * (1 + slack_percent / 100)))
    return int(np.maximum(sizes - cap, 0).sum())
