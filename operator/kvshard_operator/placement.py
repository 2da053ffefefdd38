"""Pure placement: embeddings → balanced clusters → pods, with as little movement as possible.

Three steps, all deterministic for the same inputs and seed, none touching Kubernetes or etcd:

* :func:`cluster_items` — balanced k-means (RcLLM §placement): Lloyd iterations on a sample fix the
  centroids, one pass over all items ranks each item's nearest centroids, and a capacity-bounded
  assignment keeps every cluster within ``(1 + slack) · n / k`` items so no shard is a hot spot.
  :func:`pull_cooccurring` optionally nudges items that appear in the same user histories towards
  each other before clustering, so items requested together tend to share a pod.
* :func:`assign_clusters` — cluster → pods by rendezvous (highest-random-weight) hashing with
  per-pod quotas proportional to capacity. Given the previous assignment it first keeps every
  replica that may stay, then fills the gaps, so adding or removing one of N pods moves ≈ 1/N of
  the clusters (the minimum), and re-clustering maps new clusters onto the old ones they overlap.
* :func:`history_plan` — user-history blocks are small and hot: every pod gets the same budget.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int64]

_CHUNK = 16384


class PlacementError(ValueError):
    """The requested placement is impossible with the given pods or capacity."""


class NoPodsError(PlacementError):
    """No ready pod matches the selector, so there is nowhere to place clusters."""


class InsufficientCapacityError(PlacementError):
    """The clusters' KV bytes (times replicas) do not fit into the pods' capacity."""


# ---------------------------------------------------------------------------------------------
# clustering


def normalise(vectors: npt.ArrayLike) -> FloatArray:
    """Rows scaled to unit length (zero rows stay zero), as float32. Rows that already have unit
    length are returned as they are, without a copy (catalogs can be gigabytes)."""
    x = np.asarray(vectors, dtype=np.float32)
    norms = np.sqrt(np.einsum("ij,ij->i", x, x))[:, None] if x.ndim == 2 else np.linalg.norm(x)
    if x.ndim == 2 and len(x) and np.allclose(norms, 1.0, atol=1e-4):
        return x
    out: FloatArray = (x / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)
    return out


def pull_cooccurring(
    embeddings: FloatArray, histories: Iterable[Sequence[int]], percent: int
) -> FloatArray:
    """Move each item ``percent`` % of the way towards the mean of the items it co-occurs with.

    ``histories`` hold row indices into ``embeddings``. Items never seen together are unchanged.
    """
    if not 0 <= percent <= 100:
        raise ValueError("percent must be within 0..100")
    emb = normalise(embeddings)
    if percent == 0:
        return emb
    sums = np.zeros_like(emb)
    counts = np.zeros(len(emb), dtype=np.float32)
    for history in histories:
        idx = np.unique(np.asarray(history, dtype=np.int64))
        if len(idx) < 2:
            continue
        total = emb[idx].sum(axis=0)
        np.add.at(sums, idx, total[None, :] - emb[idx])
        np.add.at(counts, idx, len(idx) - 1)
    seen = counts > 0
    alpha = percent / 100.0
    out = emb.copy()
    out[seen] = (1 - alpha) * emb[seen] + alpha * sums[seen] / counts[seen, None]
    return normalise(out)


def cluster_sums(x: FloatArray, labels: IntArray, k: int) -> tuple[FloatArray, IntArray]:
    """Sum and count of the rows of each label. One ``add.reduce`` per label over the sorted rows:
    several times faster than ``add.reduceat``, which walks a 2-D matrix column by column."""
    order = np.argsort(labels, kind="stable")
    counts = np.bincount(labels, minlength=k).astype(np.int64)
    ends = np.cumsum(counts).tolist()
    xs = x[order]
    sums = np.zeros((k, x.shape[1]), dtype=np.float32)
    for c in np.flatnonzero(counts).tolist():
        np.add.reduce(xs[ends[c] - int(counts[c]):ends[c]], axis=0, out=sums[c])
    return sums, counts


def kmeans_centroids(x: FloatArray, k: int, rng: np.random.Generator, iterations: int) -> FloatArray:
    """Spherical Lloyd iterations on ``x`` from a random start; empty clusters are re-seeded."""
    centroids = x[rng.choice(len(x), size=k, replace=False)].copy()
    for _ in range(iterations):
        sums, sizes = cluster_sums(x, _top_candidates(x, centroids, 1)[0][:, 0], k)
        empty = np.flatnonzero(sizes == 0)
        sums[empty] = x[rng.choice(len(x), size=len(empty), replace=False)]
        centroids = normalise(sums)
    return centroids


def _top_m(sims: FloatArray, m: int) -> tuple[IntArray, FloatArray]:
    """Each row's ``m`` largest columns (best first) and their values; ``sims`` is overwritten."""
    if m == 1:  # the nearest centroid only (every k-means step): no second pass over the matrix
        best = np.argmax(sims, axis=1)
        return best[:, None], np.take_along_axis(sims, best[:, None], axis=1)
    rows = np.arange(len(sims))
    cand = np.empty((len(sims), m), dtype=np.int64)
    score = np.empty((len(sims), m), dtype=np.float32)
    for r in range(m):  # m argmax passes beat a full argpartition for small m
        best = np.argmax(sims, axis=1)
        cand[:, r] = best
        score[:, r] = sims[rows, best]
        sims[rows, best] = -np.inf
    return cand, score


def _top_candidates(x: FloatArray, centroids: FloatArray, m: int) -> tuple[IntArray, FloatArray]:
    """Each row's ``m`` most similar centroids (best first) and their similarities — exact, in
    chunks so the similarity matrix never exceeds ``_CHUNK × k``."""
    n, k = len(x), len(centroids)
    m = min(m, k)
    cand = np.empty((n, m), dtype=np.int64)
    score = np.empty((n, m), dtype=np.float32)
    centroids_t = np.ascontiguousarray(centroids.T)
    for start in range(0, n, _CHUNK):
        cand[start : start + _CHUNK], score[start : start + _CHUNK] = _top_m(
            x[start : start + _CHUNK] @ centroids_t, m)
    return cand, score


def _capacity_bounded(
    x: FloatArray, centroids: FloatArray, cand: IntArray, score: FloatArray, cap: int
) -> IntArray:
    """Assign rows to candidate clusters best-first while clusters have room; rare leftovers go to
    the most similar cluster that still has room."""
    n, k = len(x), len(centroids)
    labels = np.full(n, -1, dtype=np.int64)
    remaining = np.full(k, cap, dtype=np.int64)
    for r in range(cand.shape[1]):
        idx = np.flatnonzero(labels < 0)
        if len(idx) == 0:
            break
        c, s = cand[idx, r], score[idx, r]
        order = np.lexsort((idx, -s, c))  # by cluster, best score first, stable by row
        idx, c = idx[order], c[order]
        rank = np.arange(len(c)) - np.searchsorted(c, c, side="left")
        ok = rank < remaining[c]
        labels[idx[ok]] = c[ok]
        remaining -= np.bincount(c[ok], minlength=k)
    for row in np.flatnonzero(labels < 0):
        sims = centroids @ x[row]
        sims[remaining <= 0] = -np.inf
        best = int(np.argmax(sims))
        labels[row] = best
        remaining[best] -= 1
    return labels


def cluster_items(
    embeddings: npt.ArrayLike,
    k: int,
    *,
    seed: int = 0,
    slack_percent: int = 10,
    iterations: int = 10,
    sample_per_cluster: int = 32,
    candidates: int = 4,
) -> IntArray:
    """Balanced k-means labels (0..k'-1, k' = min(k, n)) for each row of ``embeddings``.

    No cluster exceeds ``ceil((1 + slack_percent/100) · n / k')`` items. Same inputs and seed give
    the same labels.
    """
    x = normalise(embeddings)
    n = len(x)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if k < 1:
        raise ValueError("k must be >= 1")
    k = min(k, n)
    rng = np.random.default_rng(seed)
    sample_size = min(n, max(k * sample_per_cluster, 10_000))
    sample = x if sample_size == n else x[np.sort(rng.choice(n, size=sample_size, replace=False))]
    centroids = kmeans_centroids(sample, k, rng, iterations)
    cand, score = _top_candidates(x, centroids, candidates)
    cap = max(1, -(-n * (100 + slack_percent) // (100 * k)))
    return _capacity_bounded(x, centroids, cand, score, cap)


# ---------------------------------------------------------------------------------------------
# cluster → pods


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _mix(a: npt.NDArray[np.uint64], b: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64 finaliser over (a xor b·golden); a stable, well-spread rendezvous weight."""
    with np.errstate(over="ignore"):
        z = a ^ (b * np.uint64(0x9E3779B97F4A7C15))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        out: npt.NDArray[np.uint64] = z ^ (z >> np.uint64(31))
        return out


def rendezvous_scores(clusters: Sequence[int], pods: Sequence[str]) -> npt.NDArray[np.uint64]:
    """Matrix [cluster, pod] of rendezvous weights, seeded by cluster id and pod name."""
    c = np.array([_hash64(f"cluster/{cid}") for cid in clusters], dtype=np.uint64)
    p = np.array([_hash64(f"pod/{name}") for name in pods], dtype=np.uint64)
    return _mix(c[:, None], p[None, :])


def _quotas(total: int, capacity: Mapping[str, int], held: Mapping[str, int]) -> dict[str, int]:
    """Largest-remainder split of ``total`` replicas proportional to capacity; ties go to pods that
    already hold more (so a resize does not shuffle the rounding)."""
    pods = sorted(capacity)
    cap_sum = sum(capacity.values())
    exact = {p: total * capacity[p] / cap_sum for p in pods}
    quota = {p: int(exact[p]) for p in pods}
    rest = total - sum(quota.values())
    order = sorted(pods, key=lambda p: (-(exact[p] - quota[p]), -held.get(p, 0), _hash64(p)))
    for p in order[:rest]:
        quota[p] += 1
    return quota


def assign_clusters(
    clusters: Sequence[int],
    capacity: Mapping[str, int],
    *,
    replicas: int = 1,
    previous: Mapping[int, Sequence[str]] | None = None,
    cluster_bytes: Mapping[int, int] | None = None,
) -> dict[int, list[str]]:
    """Cluster → pods (``min(replicas, pods)`` distinct pods each), quotas proportional to
    ``capacity`` (bytes per pod). Replicas in ``previous`` stay where they are while their pod exists
    and is within quota; the rest go to the highest-rendezvous pod with room.

    Raises :class:`NoPodsError` without pods, :class:`InsufficientCapacityError` when a pod would hold
    more than its capacity of ``cluster_bytes``.
    """
    if not capacity:
        raise NoPodsError("no ready pods match the selector")
    pods = sorted(capacity)
    col = {p: j for j, p in enumerate(pods)}
    r = min(max(replicas, 1), len(pods))
    clusters = sorted(clusters)
    previous = previous or {}
    held: dict[str, int] = {}
    for c in clusters:
        for p in previous.get(c, ()):
            held[p] = held.get(p, 0) + 1
    quota = _quotas(len(clusters) * r, capacity, held)
    scores = rendezvous_scores(clusters, pods)
    row = {c: i for i, c in enumerate(clusters)}
    load = dict.fromkeys(pods, 0)
    result: dict[int, list[str]] = {c: [] for c in clusters}

    # Keep each cluster's best surviving replica first, then second ones, and so on: what a full pod
    # sheds are then replicas of distinct clusters, which the new room can take without swaps.
    keep: list[tuple[int, int, int, str]] = []
    for c in clusters:
        alive = sorted((p for p in dict.fromkeys(previous.get(c, ())) if p in col),
                       key=lambda p: -int(scores[row[c], col[p]]))
        keep += [(rank, -int(scores[row[c], col[p]]), c, p) for rank, p in enumerate(alive)]
    keep.sort()
    for _rank, _score, c, p in keep:
        if load[p] < quota[p] and len(result[c]) < r:
            result[c].append(p)
            load[p] += 1

    ranked = np.argsort(-scores.astype(np.float64), axis=1, kind="stable") if clusters else None
    for c in clusters:
        if len(result[c]) >= r:
            continue
        assert ranked is not None
        for j in ranked[row[c]]:
            p = pods[int(j)]
            if load[p] < quota[p] and p not in result[c]:
                result[c].append(p)
                load[p] += 1
                if len(result[c]) >= r:
                    break
        while len(result[c]) < r:  # only pods that already hold c have room: swap one cluster over
            _swap_in(c, result, pods, load, quota)
        result[c].sort(key=lambda p: -int(scores[row[c], col[p]]))

    if cluster_bytes is not None:
        used = dict.fromkeys(pods, 0)
        for c, holders in result.items():
            for p in holders:
                used[p] += cluster_bytes.get(c, 0)
        over = sorted(p for p in pods if used[p] > capacity[p])
        if over:
            p = over[0]
            raise InsufficientCapacityError(
                f"{len(over)} pod(s) over capacity, e.g. {p} needs {used[p]} bytes but holds {capacity[p]}"
            )
    return result


def _swap_in(
    c: int, result: dict[int, list[str]], pods: Sequence[str], load: dict[str, int], quota: Mapping[str, int]
) -> None:
    """Give ``c`` one more replica while keeping every quota exact: find a pod ``q`` with room (it
    holds ``c`` already) and a full pod ``p`` without ``c``; move some cluster ``d`` from ``p`` to ``q``
    and put ``c`` on ``p``. Falls back to the least-loaded pod without ``c`` if no swap exists."""
    roomy = [q for q in pods if load[q] < quota[q]]
    for p in pods:
        if p in result[c]:
            continue
        for q in roomy:
            for d, holders in result.items():
                if d != c and p in holders and q not in holders:
                    holders[holders.index(p)] = q
                    load[q] += 1
                    result[c].append(p)
                    return
    p = min((q for q in pods if q not in result[c]), key=lambda q: (load[q] - quota[q], q))
    result[c].append(p)
    load[p] += 1


def moved_replicas(old: Mapping[int, Sequence[str]], new: Mapping[int, Sequence[str]]) -> int:
    """How many (cluster, pod) replicas of ``new`` were not in ``old`` (each one is a cache warm-up)."""
    return sum(len(set(pods) - set(old.get(c, ()))) for c, pods in new.items())


def base_replicas(previous: Mapping[int, Sequence[str]], replicas: int) -> dict[int, list[str]]:
    """The first ``replicas`` holders of each cluster: what :func:`assign_clusters` placed (it lists
    its holders first; the rebalancer appends the replicas it adds)."""
    return {c: list(dict.fromkeys(h))[:max(replicas, 1)] for c, h in previous.items()}


def keep_extra_replicas(
    assignment: Mapping[int, Sequence[str]],
    previous: Mapping[int, Sequence[str]],
    capacity: Mapping[str, int],
    *,
    replicas: int,
    cluster_bytes: Mapping[int, int] | None = None,
) -> dict[int, list[str]]:
    """``assignment`` (placed from :func:`base_replicas` of ``previous``) plus, for every cluster that
    ``previous`` held on more than ``replicas`` pods (the rebalancer extended it), each previous
    holder that still exists and has room, after the placed ones.

    :func:`assign_clusters` gives every cluster exactly ``replicas`` holders, so without this a
    re-placement for a pod change would drop every hot-cluster replica and the next rebalance
    interval would add them back: churn and cold caches on every scaling event. Placing the base
    replicas exactly as without a rebalancer keeps re-placement a fixed point; warm replicas of a
    hot cluster are never dropped here (the rebalancer's cold pass does that when it cools).
    """
    sizes = cluster_bytes or {}
    out = {c: list(h) for c, h in assignment.items()}
    used = dict.fromkeys(capacity, 0)
    for c, holders in out.items():
        for p in holders:
            if p in used:
                used[p] += sizes.get(c, 0)
    for c in sorted(out):
        before = list(dict.fromkeys(previous.get(c, ())))
        if len(before) <= max(replicas, 1):
            continue
        for p in before:
            if p in capacity and p not in out[c] and used[p] + sizes.get(c, 0) <= capacity[p]:
                out[c].append(p)
                used[p] += sizes.get(c, 0)
    return out


def inherit_assignment(
    old_labels: Mapping[str, int], new_labels: Mapping[str, int], old_assignment: Mapping[int, Sequence[str]]
) -> dict[int, list[str]]:
    """The ``previous`` to pass to :func:`assign_clusters` after re-clustering: each new cluster takes
    the pods of the old cluster it shares most items with (each old cluster is inherited once)."""
    overlap: dict[tuple[int, int], int] = {}
    for item, new_c in new_labels.items():
        old_c = old_labels.get(item)
        if old_c is not None:
            overlap[(new_c, old_c)] = overlap.get((new_c, old_c), 0) + 1
    taken_new: set[int] = set()
    taken_old: set[int] = set()
    inherited: dict[int, list[str]] = {}
    for (new_c, old_c), _count in sorted(overlap.items(), key=lambda kv: (-kv[1], kv[0])):
        if new_c in taken_new or old_c in taken_old or old_c not in old_assignment:
            continue
        taken_new.add(new_c)
        taken_old.add(old_c)
        inherited[new_c] = list(old_assignment[old_c])
    return inherited


# ---------------------------------------------------------------------------------------------
# user history


@dataclasses.dataclass(frozen=True)
class HistoryPlan:
    """Where user-history blocks live: on every listed pod, LRU-evicted within ``bytes_per_pod``."""

    policy: str
    bytes_per_pod: int
    pods: tuple[str, ...]


def history_plan(policy: str, bytes_per_pod: int, pods: Iterable[str]) -> HistoryPlan:
    """``ReplicateAll`` → every pod caches history within its budget; ``None`` → no pod does."""
    if policy == "ReplicateAll":
        return HistoryPlan(policy, bytes_per_pod, tuple(sorted(pods)))
    if policy == "None":
        return HistoryPlan(policy, 0, ())
    raise ValueError(f"unknown user-history policy {policy!r}")


_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


def parse_bytes(quantity: str) -> int:
    """A Kubernetes-style byte quantity (``4Gi``, ``500M``, ``1024``) as an integer."""
    text = quantity.strip()
    digits = len(text) - len(text.lstrip("0123456789"))
    number, unit = text[:digits], text[digits:]
    if not number or unit not in _UNITS:
        raise ValueError(f"not a byte quantity: {quantity!r}")
    return int(number) * _UNITS[unit]
