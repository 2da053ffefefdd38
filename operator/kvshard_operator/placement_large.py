"""Balanced clustering of millions of items in bounded memory and time (issue 19).

:func:`placement.cluster_items` compares every item with every centroid on one float32 matrix: at
10 M items × 10,000 clusters that is 7.7·10¹³ flops (≈ 13 minutes on two cores) and 15 GB of
vectors held twice. Here the same balanced k-means is done the way large vector indexes do it:

* **Train on a sample, two levels.** ``k₁ ≈ √k`` coarse centroids are trained on ``256 k₁`` rows
  of a sample (32 items per final cluster, as :mod:`placement`), the sample is split among them with
  the same capacity bound, and each coarse group trains its share of the ``k`` fine centroids
  (shares proportional to the group's sample size; the groups in parallel); a few global Lloyd
  steps on the sample, routed as the assignment routes, then fix the borders between groups.
  Training costs ``O(sample · (k₁ + k/k₁))``.
* **Assign in chunks.** Each chunk of rows (read from a :class:`~vectors.VectorSource`, never the
  whole matrix) is compared with the coarse centroids, then only with the fine centroids of its
  ``probes`` nearest groups; each row keeps its ``candidates`` best fine clusters (int32 + float32:
  32 bytes per item for 4 candidates — 320 MB at 10 M). The search is exact within the probed
  groups: the nearest group first (one product per group, which also gives each row's
  ``candidates``-th best similarity), then the other probed groups, keeping only the similarities
  above that threshold. Chunks run in parallel threads, one BLAS thread each.
* **Balance globally.** Rows take their best candidate cluster best-score-first while the cluster
  is below ``ceil((1 + slack) · n / k)`` (exactly :mod:`placement`'s rule); the few rows whose
  candidates are all full are re-read and go to the most similar cluster that still has room.

The result carries the centroids, so incremental placement (:mod:`catalog_update`: a new item to the
nearest cluster with room) keeps using the same ones (:meth:`LargePlacement.update_centroids`).
Peak memory is the sample (``32 k × dim`` float32), one chunk per thread, and the candidate lists.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from kvshard_operator.catalog_update import Centroids
from kvshard_operator.placement import cluster_sums, kmeans_centroids
from kvshard_operator.vectors import FloatArray, IndexArray, VectorSource, unit

Labels = npt.NDArray[np.int32]

CHUNK = 65536
"""Rows per assignment chunk: 100 MB of float32 at 384 dimensions."""

COARSE_SAMPLE = 256
"""Sample rows per coarse centroid that train the coarse level."""

_T = TypeVar("_T")


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


# ---------------------------------------------------------------------------------------------- parallel work


def _workers() -> int:
    return max(1, os.cpu_count() or 1)


def _blas_single_thread() -> contextlib.AbstractContextManager[object]:
    """BLAS limited to one thread (when ``threadpoolctl`` is there): the work is split into
    independent pieces (chunks of rows, coarse groups) that run in parallel Python threads — numpy
    releases the GIL while it multiplies, sorts and gathers — which keeps every core busy also in
    the selection and bookkeeping between the products, where a multi-threaded BLAS would leave
    all cores but one idle."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - an operator image without it is only slower
        return contextlib.nullcontext()
    limits: contextlib.AbstractContextManager[object] = threadpool_limits(limits=1, user_api="blas")
    return limits


def _parallel(work: Callable[[int], _T], items: Sequence[int]) -> list[_T]:
    """``work`` of every item, in order, on :func:`_workers` threads with one BLAS thread each."""
    workers = min(_workers(), len(items))
    if workers <= 1:
        return [work(i) for i in items]
    with _blas_single_thread(), concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(work, items))


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
    # the coarse level only routes: COARSE_SAMPLE rows per coarse centroid fix it as well as the
    # whole sample does, and _refine moves it to its groups' means anyway
    few = min(len(x), COARSE_SAMPLE * k1)
    xc = x if few == len(x) else x[np.sort(rng.choice(len(x), size=few, replace=False))]
    coarse = kmeans_centroids(xc, k1, rng, iterations)
    del xc
    cand, score = top_candidates(x, coarse, min(4, k1))
    group_cap = -(-len(x) * (100 + slack_percent) // (100 * k1))
    groups = capacity_bounded(cand, score, group_cap, k1)
    del cand, score
    _place_leftovers(lambda rows: x[rows], coarse, groups, group_cap)
    group_sizes = np.bincount(groups, minlength=k1).astype(np.int64)
    share = _shares(group_sizes, k)
    order = np.argsort(groups, kind="stable")
    bounds = np.concatenate(([0], np.cumsum(group_sizes)))
    trained = [int(g) for g in np.flatnonzero(share)]

    def fine_of(g: int) -> FloatArray:
        # each group its own generator, so the result does not depend on which thread ran it
        group_rng = np.random.default_rng((seed, g))
        return kmeans_centroids(x[order[bounds[g]:bounds[g + 1]]], int(share[g]), group_rng, iterations)

    fine = _parallel(fine_of, trained)
    group = np.repeat(np.array(trained, dtype=np.int64), share[trained])
    book = Codebook(coarse, np.concatenate(fine), group, tuple(np.flatnonzero(group == g) for g in range(k1)))
    return _refine(book, x, refine, probes)


def _refine(book: Codebook, x: FloatArray, iterations: int, probes: int) -> Codebook:
    """Global Lloyd steps on the sample, each row routed as :func:`assign` routes it: fine centroids
    trained inside one coarse group never saw the rows just across the group's border, and those
    rows are exactly the ones routing gets wrong. Coarse centroids become their groups' means."""
    for _ in range(iterations):
        lab = _candidates(lambda start, stop: x[start:stop], len(x), _Router.of(book, probes), 1)[0][:, 0]
        sums, counts = cluster_sums(x, lab.astype(np.int64), book.k)
        present = np.flatnonzero(counts)
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


@dataclasses.dataclass(frozen=True)
class _Router:
    """A codebook laid out for routing: the coarse centroids of the groups that have fine clusters
    (transposed, ``dim × groups``) and each such group's fine centroids (``dim × size``, contiguous)
    with their cluster numbers."""

    coarse_t: FloatArray
    blocks: tuple[FloatArray, ...]
    members: tuple[npt.NDArray[np.int32], ...]
    probes: int

    @classmethod
    def of(cls, book: Codebook, probes: int) -> _Router:
        live = [g for g, ids in enumerate(book.members) if len(ids)]
        return cls(np.ascontiguousarray(book.coarse[live].T),
                   tuple(np.ascontiguousarray(book.fine[book.members[g]].T) for g in live),
                   tuple(book.members[g].astype(np.int32) for g in live),
                   max(1, min(probes, len(live))))


def _hits(mask: npt.NDArray[np.bool_]) -> tuple[IndexArray, IndexArray]:
    """(row, column) of the true entries of a 2-D mask, row-major (a flat ``nonzero`` is several
    times faster than the 2-D one)."""
    flat = np.flatnonzero(mask)
    rows, cols = np.divmod(flat, mask.shape[1])
    return rows, cols


def _probes(sims: FloatArray, probes: int) -> tuple[IndexArray, IndexArray, IndexArray]:
    """Each row's most similar group, and (row, group) for its other ``probes - 1`` most similar
    ones. One ``partition`` gives each row's ``probes``-th best similarity, a comparison the set;
    rows with ties at that value (a zero row ties everywhere) take exactly ``probes`` groups."""
    n, k1 = sims.shape
    best = np.argmax(sims, axis=1)
    if probes >= k1:
        mask = np.ones((n, k1), dtype=bool)
    else:
        mask = sims >= np.partition(sims, k1 - probes, axis=1)[:, k1 - probes, None]
        if np.count_nonzero(mask) > n * probes:
            tied = np.flatnonzero(np.count_nonzero(mask, axis=1) > probes)
            part = np.argpartition(-sims[tied], probes - 1, axis=1)[:, :probes]
            mask[tied] = False
            mask[tied[:, None], part] = True
            top = np.argmax(np.take_along_axis(sims[tied], part, axis=1), axis=1)
            best[tied] = part[np.arange(len(tied)), top]
    mask[np.arange(n), best] = False
    rows, groups = _hits(mask)
    return best, rows, groups


def _desc_key(score: FloatArray) -> npt.NDArray[np.uint64]:
    """Unsigned keys (< 2³²) that sort ascending as ``score`` sorts descending (``-0.0`` as ``0.0``)."""
    bits = (np.asarray(score, dtype=np.float32) + np.float32(0.0)).view(np.uint32)
    ascending = np.where(bits >= 0x80000000, ~bits, bits | np.uint32(0x80000000))
    return (~ascending).astype(np.uint64)


def _best_per_row(n: int, rows: IndexArray, cand: npt.NDArray[np.int32], score: FloatArray,
                  m: int) -> tuple[npt.NDArray[np.int32], FloatArray]:
    """The ``m`` best (cluster, similarity) entries of each of ``n`` rows, best first, equal
    similarities by cluster number; ``-1`` / ``-inf`` where a row has fewer."""
    key = (rows.astype(np.uint64) << np.uint64(32)) | _desc_key(score)
    if n <= 1 << 16:  # row, similarity and the cluster's low 16 bits in one word: a plain (vectorised) sort
        key = (key << np.uint64(16)) | (cand.astype(np.uint64) & np.uint64(0xFFFF))
        order = np.argsort(key)
    else:
        order = np.argsort(key, kind="stable")
    counts = np.bincount(rows, minlength=n)
    rows = rows[order]
    rank = np.arange(len(rows)) - (np.cumsum(counts) - counts)[rows]
    keep = rank < m
    out_c = np.full((n, m), -1, dtype=np.int32)
    out_s = np.full((n, m), -np.inf, dtype=np.float32)
    out_c[rows[keep], rank[keep]] = cand[order[keep]]
    out_s[rows[keep], rank[keep]] = score[order[keep]]
    return out_c, out_s


def _chunk_candidates(x: FloatArray, router: _Router, m: int) -> tuple[npt.NDArray[np.int32], FloatArray]:
    """The ``m`` best fine clusters of each row among the fine centroids of its ``probes`` nearest
    coarse groups (best first), exact.

    Two passes, each one matrix product per group over the rows that visit it: first every row's
    nearest group, which also gives the row's ``m``-th best similarity so far; then the other
    probed groups, where only similarities above that threshold can enter the row's ``m`` best, so
    only those (a few per row) are kept — no per-row selection over all probed clusters."""
    n = len(x)
    best, rest_rows, rest_groups = _probes(x @ router.coarse_t, router.probes)
    threshold = np.empty(n, dtype=np.float32)
    found_rows: list[IndexArray] = []
    found_cand: list[npt.NDArray[np.int32]] = []
    found_score: list[FloatArray] = []

    def scan(rows: IndexArray, groups: IndexArray, first: bool) -> None:
        # rows stay ascending within a group; 16-bit group numbers sort by radix
        order = np.argsort(groups.astype(np.uint16) if len(router.blocks) <= 1 << 16 else groups, kind="stable")
        rows, groups = rows[order], groups[order]
        cuts = np.flatnonzero(np.diff(groups)) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(rows)], strict=True):
            g = int(groups[a])
            r = rows[a:b]
            sims = np.take(x, r, axis=0) @ router.blocks[g]
            width = sims.shape[1]
            if not first:
                hit = sims > threshold[r][:, None]
            elif width <= m:  # every cluster of the group is a candidate, and nothing bounds the rest
                threshold[r] = -np.inf
                hit = np.ones(sims.shape, dtype=bool)
            else:
                top = np.partition(sims, width - m, axis=1)[:, width - m] if m > 1 else sims.max(axis=1)
                threshold[r] = top
                hit = sims >= top[:, None]
                if np.count_nonzero(hit) != len(r) * m:  # ties at the threshold: the first ones
                    above = sims > top[:, None]
                    tie = hit & ~above
                    hit = above | (tie & (np.cumsum(tie, axis=1) <= (m - np.count_nonzero(above, axis=1))[:, None]))
            hr, hc = _hits(hit)
            found_rows.append(r[hr])
            found_cand.append(router.members[g][hc])
            found_score.append(sims[hr, hc])

    scan(np.arange(n), best, True)
    if len(rest_rows):
        scan(rest_rows, rest_groups, False)
    return _best_per_row(n, np.concatenate(found_rows), np.concatenate(found_cand), np.concatenate(found_score), m)


def _candidates(read: Callable[[int, int], FloatArray], n: int, router: _Router,
                m: int) -> tuple[npt.NDArray[np.int32], FloatArray]:
    """:func:`_chunk_candidates` of rows ``0..n`` read in chunks, the chunks in parallel."""
    cand = np.empty((n, m), dtype=np.int32)
    score = np.empty((n, m), dtype=np.float32)
    # chunks small enough that every worker gets a few (a 320 k sample is not 5 chunks on 2 cores)
    size = max(1024, min(CHUNK, -(-n // (4 * _workers()))))

    def one(start: int) -> None:
        stop = min(n, start + size)
        cand[start:stop], score[start:stop] = _chunk_candidates(read(start, stop), router, m)

    _parallel(one, range(0, n, size))
    return cand, score


def capacity_bounded(cand: IndexArray | npt.NDArray[np.int32], score: FloatArray, cap: int, k: int) -> Labels:
    """Rows take their candidates best-first while the cluster has fewer than ``cap`` rows; ``-1``
    where every candidate filled up (the caller places those). Ties go to the better score, then the
    lower row, so the result does not depend on chunking.

    Each round sorts only keys (cluster, similarity) — no permutation — to find, for each cluster
    asked by more rows than it has room for, the key of the last row it takes; rows with better
    keys get in, rows with exactly that key get in by row number while room is left."""
    n = len(cand)
    labels = np.full(n, -1, dtype=np.int32)
    remaining = np.full(k, cap, dtype=np.int64)
    for r in range(cand.shape[1]):
        idx = np.flatnonzero(labels < 0)
        if len(idx) == 0:
            break
        c = cand[idx, r].astype(np.int64)
        valid = (c >= 0) & (remaining[np.maximum(c, 0)] > 0)
        idx, c = idx[valid], c[valid]
        key = (c.astype(np.uint64) << np.uint64(32)) | _desc_key(score[idx, r])
        wanting = np.bincount(c, minlength=k)
        full = np.flatnonzero(wanting > remaining)
        if len(full):
            starts = np.cumsum(wanting) - wanting
            last = np.full(k, np.iinfo(np.uint64).max, dtype=np.uint64)
            last[full] = np.sort(key)[starts[full] + remaining[full] - 1]
            cut = last[c]
            ok = key < cut
            tie = np.flatnonzero(key == cut)  # rows of full clusters with the key of the last one taken
            if len(tie):
                room = remaining - np.bincount(c[ok], minlength=k)
                tie = tie[np.argsort(c[tie], kind="stable")]  # by cluster, rows ascending
                tc = c[tie]
                counts = np.bincount(tc, minlength=k)
                rank = np.arange(len(tie)) - (np.cumsum(counts) - counts)[tc]
                ok[tie[rank < room[tc]]] = True
            idx, c = idx[ok], c[ok]
        labels[idx] = c
        remaining -= np.bincount(c, minlength=k)
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
    cand, score = _candidates(source.read, n, _Router.of(book, probes), min(candidates, k))
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
