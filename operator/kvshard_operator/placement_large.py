"""Balanced clustering of millions of items in bounded memory and time (issue 19).

:func:`placement.cluster_items` compares every item with every centroid on one float32 matrix: at
10 M items × 10,000 clusters that is 7.7·10¹³ flops (≈ 13 minutes on two cores) and 15 GB of
vectors held twice. Here the same balanced k-means is done the way large vector indexes do it:

* **Train on a sample, two levels.** ``k₁ ≈ √k`` coarse centroids are trained on a sample (32
  items per final cluster, as :mod:`placement`), the sample is split among them with the same
  capacity bound, and each coarse group trains its share of the ``k`` fine centroids (shares
  proportional to the group's sample size); a few global Lloyd steps on the sample, routed as the
  assignment routes, then fix the borders between groups. Training costs ``O(sample · (k₁ + k/k₁))``.
* **Assign in chunks.** Each chunk of rows (read from a :class:`~vectors.VectorSource`, never the
  whole matrix) is compared with the coarse centroids, then only with the fine centroids of its
  ``probes`` nearest groups; each row keeps its ``candidates`` best fine clusters (int32 + float32:
  32 bytes per item for 4 candidates — 320 MB at 10 M).
* **Balance globally.** Rows take their best candidate cluster best-score-first while the cluster
  is below ``ceil((1 + slack) · n / k)`` (exactly :mod:`placement`'s rule); the few rows whose
  candidates are all full are re-read and go to the most similar cluster that still has room.

The result carries the centroids, so incremental placement (:mod:`catalog_update`: a new item to the
nearest cluster with room) keeps using the same ones (:meth:`LargePlacement.update_centroids`).
Peak memory is the sample (``32 k × dim`` float32), one chunk, and the candidate lists.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvshard_operator.catalog_update import Centroids
from kvshard_operator.placement import kmeans_centroids
from kvshard_operator.vectors import FloatArray, IndexArray, VectorSource, unit

Labels = npt.NDArray[np.int32]

CHUNK = 65536
"""Rows per assignment chunk: 100 MB of float32 at 384 dimensions."""


@dataclasses.dataclass(frozen=True)
class Codebook:
    """Two-level centroids: ``fine[c]`` belongs to coarse group ``group[c]``; ``members[g]`` lists the
    fine clusters of group ``g``."""

    coarse: FloatArray
    fine: FloatArray
    group: npt.NDArray[np.int64]
    members: tuple[IndexArray, ...]

    @property
    def k(self) -> int:
        return int(self.fine.shape[0])


@dataclasses.dataclass(frozen=True)
class LargePlacement:
    """Labels (0..k-1) of every row, the codebook they came from, and cluster sizes."""

    labels: Labels
    codebook: Codebook
    cap: int

    @property
    def sizes(self) -> npt.NDArray[np.int64]:
        return np.bincount(self.labels, minlength=self.codebook.k).astype(np.int64)

    def update_centroids(self) -> Centroids:
        """The :class:`catalog_update.Centroids` (sums and counts) that place later catalog changes
        against these same centroids."""
        counts = self.sizes
        return Centroids((self.codebook.fine * counts[:, None]).astype(np.float32), counts)


# ---------------------------------------------------------------------------------------------- training


def _shares(sizes: npt.NDArray[np.int64], k: int) -> npt.NDArray[np.int64]:
    """``k`` split proportionally to ``sizes`` (largest remainder), ≥ 1 per non-empty group, never
    more than the group's size."""
    exact = sizes * (k / max(int(sizes.sum()), 1))
    floor = np.maximum(np.floor(exact).astype(np.int64), (sizes > 0).astype(np.int64))
    share: npt.NDArray[np.int64] = np.minimum(floor, sizes)
    while share.sum() != k:
        if share.sum() < k:
            room = np.flatnonzero(share < sizes)
            share[room[np.argmax((exact - share)[room])]] += 1
        else:
            over = np.flatnonzero(share > 1)
            share[over[np.argmin((exact - share)[over])]] -= 1
    return share


def train(source: VectorSource, k: int, *, seed: int = 0, sample_per_cluster: int = 32,
          iterations: int = 10, slack_percent: int = 10, refine: int = 3, probes: int = 6) -> Codebook:
    """A two-level codebook of ``min(k, rows)`` fine centroids, trained on a sample of ``source``."""
    n = source.rows
    k = max(1, min(k, n))
    rng = np.random.default_rng(seed)
    size = min(n, max(k * sample_per_cluster, 10_000))
    rows = np.arange(n) if size == n else np.sort(rng.choice(n, size=size, replace=False))
    x = source.take(rows)
    k1 = max(1, min(k, round(math.sqrt(k))))
    coarse = kmeans_centroids(x, k1, rng, iterations)
    cand, score = top_candidates(x, coarse, min(4, k1))
    group_cap = -(-len(x) * (100 + slack_percent) // (100 * k1))
    groups = capacity_bounded(cand, score, group_cap, k1)
    _place_leftovers(lambda rows: x[rows], coarse, groups, group_cap)
    group_sizes = np.bincount(groups, minlength=k1).astype(np.int64)
    share = _shares(group_sizes, k)
    fine: list[FloatArray] = []
    owner: list[IndexArray] = []
    order = np.argsort(groups, kind="stable")
    bounds = np.concatenate(([0], np.cumsum(group_sizes)))
    for g in range(k1):
        if share[g] == 0:
            continue
        xg = x[order[bounds[g]:bounds[g + 1]]]
        fine.append(kmeans_centroids(xg, int(share[g]), rng, iterations))
        owner.append(np.full(int(share[g]), g, dtype=np.int64))
    group = np.concatenate(owner)
    book = Codebook(coarse, np.concatenate(fine), group, tuple(np.flatnonzero(group == g) for g in range(k1)))
    return _refine(book, x, refine, probes)


def _refine(book: Codebook, x: FloatArray, iterations: int, probes: int) -> Codebook:
    """Global Lloyd steps on the sample, each row routed as :func:`assign` routes it: fine centroids
    trained inside one coarse group never saw the rows just across the group's border, and those
    rows are exactly the ones routing gets wrong. Coarse centroids become their groups' means."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for _ in range(iterations):
            lab = np.concatenate([_chunk_candidates(x[s:s + CHUNK], book, probes, 1, pool)[0][:, 0]
                                  for s in range(0, len(x), CHUNK)])
            order = np.argsort(lab, kind="stable")
            present, first = np.unique(lab[order], return_index=True)
            sums = np.zeros_like(book.fine)
            sums[present] = np.add.reduceat(x[order], first)
            fine = book.fine.copy()
            fine[present] = unit(sums[present])
            group_sums = np.zeros_like(book.coarse)
            np.add.at(group_sums, book.group, sums)
            keep = np.linalg.norm(group_sums, axis=1) == 0
            coarse = np.where(keep[:, None], book.coarse, unit(group_sums)).astype(np.float32)
            book = Codebook(coarse, fine, book.group, book.members)
    return book


# ---------------------------------------------------------------------------------------------- assignment


def top_candidates(x: FloatArray, centroids: FloatArray, m: int) -> tuple[IndexArray, FloatArray]:
    """Each row's ``m`` most similar centroids (unordered) and their similarities, exact."""
    m = min(m, len(centroids))
    sims = x @ np.ascontiguousarray(centroids.T)
    part = np.argpartition(-sims, m - 1, axis=1)[:, :m] if m < sims.shape[1] else np.tile(
        np.arange(sims.shape[1]), (len(x), 1))
    return part.astype(np.int64), np.take_along_axis(sims, part, axis=1)


def _blas_single_thread() -> contextlib.AbstractContextManager[object]:
    """BLAS limited to one thread (when ``threadpoolctl`` is there): the per-group products are
    small, and a multi-threaded BLAS spends more time waking its threads than multiplying, so the
    groups run in parallel Python threads instead (numpy releases the GIL while it multiplies)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - an operator image without it is only slower
        return contextlib.nullcontext()
    limits: contextlib.AbstractContextManager[object] = threadpool_limits(limits=1, user_api="blas")
    return limits


def _chunk_candidates(x: FloatArray, book: Codebook, probes: int, m: int,
                      pool: concurrent.futures.Executor) -> tuple[IndexArray, FloatArray]:
    """The ``m`` best fine clusters of each row among the fine centroids of its ``probes`` nearest
    coarse groups (best first)."""
    groups, _ = top_candidates(x, book.coarse, probes)
    width = groups.shape[1] * m
    cand = np.full((len(x), width), -1, dtype=np.int64)
    score = np.full((len(x), width), -np.inf, dtype=np.float32)

    def one(p: int, rows: IndexArray, g: int) -> None:
        ids = book.members[g]
        local, sims = top_candidates(x[rows], book.fine[ids], m)
        cand[rows, p * m:p * m + local.shape[1]] = ids[local]
        score[rows, p * m:p * m + local.shape[1]] = sims

    jobs = []
    for p in range(groups.shape[1]):
        col = groups[:, p]
        order = np.argsort(col, kind="stable")
        bounds = np.searchsorted(col[order], np.arange(len(book.members) + 1))
        jobs += [pool.submit(one, p, order[bounds[g]:bounds[g + 1]], int(g)) for g in np.flatnonzero(np.diff(bounds))]
    with _blas_single_thread():
        for job in jobs:
            job.result()
    best = np.argsort(-score, axis=1, kind="stable")[:, :m]
    return np.take_along_axis(cand, best, axis=1), np.take_along_axis(score, best, axis=1)


def capacity_bounded(cand: IndexArray | npt.NDArray[np.int32], score: FloatArray, cap: int, k: int) -> Labels:
    """Rows take their candidates best-first while the cluster has fewer than ``cap`` rows; ``-1``
    where every candidate filled up (the caller places those). Ties go to the better score, then the
    lower row, so the result does not depend on chunking."""
    n = len(cand)
    labels = np.full(n, -1, dtype=np.int32)
    remaining = np.full(k, cap, dtype=np.int64)
    for r in range(cand.shape[1]):
        idx = np.flatnonzero(labels < 0)
        if len(idx) == 0:
            break
        c = cand[idx, r].astype(np.int64)
        s = score[idx, r]
        valid = (c >= 0) & (remaining[np.maximum(c, 0)] > 0)
        idx, c, s = idx[valid], c[valid], s[valid]
        order = np.lexsort((idx, -s, c))
        idx, c = idx[order], c[order]
        rank = np.arange(len(c)) - np.searchsorted(c, c, side="left")
        ok = rank < remaining[c]
        labels[idx[ok]] = c[ok]
        remaining -= np.bincount(c[ok], minlength=k)
    return labels


def _place_leftovers(take: Callable[[IndexArray], FloatArray], centroids: FloatArray, labels: Labels,
                     cap: int) -> None:
    """Rows without a label go to the most similar cluster that still has room (in place)."""
    k = len(centroids)
    remaining = cap - np.bincount(labels[labels >= 0], minlength=k).astype(np.int64)
    todo = np.flatnonzero(labels < 0)
    while len(todo):
        open_ = np.flatnonzero(remaining > 0)
        if len(open_) == 0:
            raise ValueError("more rows than cluster capacity")
        batch = todo[:CHUNK]
        sims = take(batch) @ np.ascontiguousarray(centroids[open_].T)
        best = np.argmax(sims, axis=1)
        c = open_[best]
        s = sims[np.arange(len(batch)), best]
        order = np.lexsort((batch, -s, c))
        rank = np.arange(len(c)) - np.searchsorted(c[order], c[order], side="left")
        ok = order[rank < remaining[c[order]]]
        labels[batch[ok]] = c[ok]
        remaining -= np.bincount(c[ok], minlength=k)
        todo = np.flatnonzero(labels < 0)


def assign(source: VectorSource, book: Codebook, *, slack_percent: int = 10, probes: int = 6,
           candidates: int = 4) -> LargePlacement:
    """Every row of ``source`` to a fine cluster of ``book``, no cluster above
    ``ceil((1 + slack_percent/100) · n / k)`` rows."""
    n, k = source.rows, book.k
    cap = max(1, -(-n * (100 + slack_percent) // (100 * k)))
    m = min(candidates, k)
    cand = np.empty((n, m), dtype=np.int32)
    score = np.empty((n, m), dtype=np.float32)
    probes = max(1, min(probes, len(book.members)))
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for start in range(0, n, CHUNK):
            stop = min(n, start + CHUNK)
            c, s = _chunk_candidates(source.read(start, stop), book, probes, m, pool)
            cand[start:stop], score[start:stop] = c, s
    labels = capacity_bounded(cand, score, cap, k)
    del cand, score
    _place_leftovers(source.take, book.fine, labels, cap)
    return LargePlacement(labels, book, cap)


def cluster_large(source: VectorSource, k: int, *, seed: int = 0, slack_percent: int = 10,
                  iterations: int = 10, sample_per_cluster: int = 32, probes: int = 6,
                  candidates: int = 4) -> LargePlacement:
    """Balanced labels for every row of ``source``: :func:`train` on a sample, then :func:`assign`."""
    book = train(source, k, seed=seed, sample_per_cluster=sample_per_cluster, iterations=iterations,
                 slack_percent=slack_percent, probes=probes)
    return assign(source, book, slack_percent=slack_percent, probes=probes, candidates=candidates)


def mean_cosine(source: VectorSource, labels: npt.NDArray[np.integer], k: int) -> float:
    """Mean cosine of each row to the mean of its cluster (the clustering's quality), two passes in
    chunks."""
    sums = np.zeros((k, source.dim), dtype=np.float64)
    for start in range(0, source.rows, CHUNK):
        x = source.read(start, start + CHUNK)
        lab = np.asarray(labels[start:start + CHUNK], dtype=np.int64)
        order = np.argsort(lab, kind="stable")
        present, first = np.unique(lab[order], return_index=True)
        sums[present] += np.add.reduceat(x[order], first)
    centres = unit(sums)
    total = 0.0
    for start in range(0, source.rows, CHUNK):
        x = source.read(start, start + CHUNK)
        total += float(np.einsum("ij,ij->", x, centres[np.asarray(labels[start:start + CHUNK], dtype=np.int64)]))
    return total / max(source.rows, 1)
