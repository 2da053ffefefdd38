"""The decision's inner loops, compiled (numba): what keeps a decision at a thousand pods in microseconds.

A routing decision is a handful of passes over small arrays: probe the item index for the request's
~20 candidates, add each candidate's tokens to the pods holding its cluster, price every pod, take
the best. Written in numpy that is ~40 calls on arrays of 20 to 1,000 elements, and each call's
overhead (~1 µs), not its arithmetic, was the decision's cost: 70 µs at p50, 120 µs at p99, twice
that inside the gRPC server where the interpreter's working set is cold between requests (measured,
docs/gateway-api.md). Each function here is one of those passes as one compiled loop, called once.

They are pure functions of arrays and numbers, with the numpy code they replace as their
specification: the same IEEE operations in the same order (numba does not reassociate floating
point unless asked), so scores, sums and ties are bit for bit what the numpy versions gave —
``tests/router/test_kernels.py`` checks them against those formulas. Each compiles on its first call
for its argument types (a fraction of a second); :func:`warm` calls them once with the types the
router uses, so the compile happens while a snapshot is built, never on a request's path.

No on-disk cache (``cache=True``): a router container's root file system is read-only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from numba import njit

IntArray = npt.NDArray[np.int64]
UIntArray = npt.NDArray[np.uint64]
Int32Array = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

UNKNOWN = -1
"""Cluster id of an item the placement does not know (a cold-start item)."""


def _probe(hashes: IntArray, directory: Any, keys: UIntArray, values: Any, shift: np.uint64,
           width: int) -> IntArray:  # pragma: no cover - compiled
    """Cluster of each hashed item (Python's ``hash`` of its id, reinterpreted as unsigned) in
    :class:`~kvshard_router.snapshot.ItemIndex`'s arrays, −1 when absent: one directory read and a scan
    of at most ``width`` sorted keys per item (the keys are padded by ``width`` past the end, so a
    scan never runs off)."""
    out = np.empty(hashes.shape[0], dtype=np.int64)
    for i in range(hashes.shape[0]):
        h = np.uint64(hashes[i])
        start = directory[h >> shift]
        found = UNKNOWN
        for j in range(start, start + width):
            if keys[j] == h:
                found = values[j]
                break
        out[i] = found
    return out


def _held_tokens(clusters: IntArray, tokens: FloatArray, indptr: Int32Array, holders: Int32Array, pods: int,
                 base: float) -> FloatArray:  # pragma: no cover - compiled
    """Per pod: ``base`` plus the tokens of the items whose cluster it holds (CSR holders), summed in
    item order; ``tokens`` has one entry per item or a single one for all. Unknown clusters add nothing."""
    held = np.zeros(pods, dtype=np.float64)
    known = indptr.shape[0] - 1
    same = tokens.shape[0] == 1
    for i in range(clusters.shape[0]):
        c = clusters[i]
        if c < 0 or c >= known:
            continue
        t = tokens[0] if same else tokens[i]
        for k in range(indptr[c], indptr[c + 1]):
            held[holders[k]] += t
    if base != 0.0:
        for p in range(pods):
            held[p] += base
    return held


def _recent_credit(clusters: IntArray, tokens: FloatArray, indptr: Int32Array, holders: Int32Array, pods: int,
                   sent_items: IntArray, sent_pods: IntArray) -> FloatArray:  # pragma: no cover - compiled
    """Per pod: the tokens of the items it was sent lately outside its placement
    (:class:`~kvshard_router.recent.RecentBlocks`): entry ``e`` says item ``sent_items[e]`` (a position
    in the request) went to pod ``sent_pods[e]``; it counts unless that pod holds the item's cluster."""
    credit = np.zeros(pods, dtype=np.float64)
    same = tokens.shape[0] == 1
    for e in range(sent_items.shape[0]):
        k, j = sent_items[e], sent_pods[e]
        if not holds(indptr, holders, clusters[k], j):
            credit[j] += tokens[0] if same else tokens[k]
    return credit


def _holds(indptr: Int32Array, holders: Int32Array, cluster: int, pod: int) -> bool:  # pragma: no cover - compiled
    """Whether ``pod`` is among the holders of ``cluster`` (False for an unknown or out-of-range cluster)."""
    if 0 <= cluster < indptr.shape[0] - 1:
        for q in range(indptr[cluster], indptr[cluster + 1]):
            if holders[q] == pod:
                return True
    return False


def _pod_cost(backlog: float, rate: float, at: float, now: float, fixed_work: float, cached_saving: float,
              cached: float) -> float:  # pragma: no cover - compiled
    """One pod's backlog at ``now`` (drained at its rate since ``at``, never below 0) plus the request's
    work there: ``fixed_work − cached_saving × cached`` (:meth:`~kvshard_router.backlog.Backlog.pricing`)."""
    left = max(0.0, backlog - rate * (now - at))
    return left + (fixed_work - cached_saving * cached)


def _backlog_cost(backlog: FloatArray, rate: FloatArray, at: FloatArray, now: float, fixed_work: float,
                  cached_saving: float, cached: FloatArray) -> FloatArray:  # pragma: no cover - compiled
    """:func:`_pod_cost` of every pod (with no work term at all when ``cached`` is empty)."""
    n = backlog.shape[0]
    out = np.empty(n, dtype=np.float64)
    if cached.shape[0] == 0:
        for p in range(n):
            out[p] = max(0.0, backlog[p] - rate[p] * (now - at[p]))
    else:
        for p in range(n):
            out[p] = pod_cost(backlog[p], rate[p], at[p], now, fixed_work, cached_saving, cached[p])
    return out


def _affinity_scores(held: FloatArray, recent: FloatArray, healthy: BoolArray, inflight: FloatArray,
                     load_penalty: float, backlog: FloatArray, rate: FloatArray, at: FloatArray, now: float,
                     fixed_work: float, cached_saving: float) -> FloatArray:  # pragma: no cover - compiled
    """The affinity policy's score of every pod (:class:`~kvshard_router.policies.AffinityPolicy`):
    cached = ``held`` (+ ``recent`` unless empty); with a backlog (``backlog`` not empty) the score is
    −:func:`_pod_cost`, else cached − ``load_penalty`` × in-flight; −inf for an unhealthy pod."""
    n = held.shape[0]
    score = np.empty(n, dtype=np.float64)
    credited, priced = recent.shape[0] > 0, backlog.shape[0] > 0
    for p in range(n):
        if not healthy[p]:
            score[p] = -np.inf
            continue
        cached = held[p] + recent[p] if credited else held[p]
        if priced:
            score[p] = -pod_cost(backlog[p], rate[p], at[p], now, fixed_work, cached_saving, cached)
        else:
            score[p] = cached - load_penalty * inflight[p]
    return score


def _best(score: FloatArray, load: FloatArray, turn: int) -> tuple[int, int]:  # pragma: no cover - compiled
    """(index, turn): the highest score (within 1e-9 relative); among ties the least ``load``, then the
    tie at ``turn + 1`` in index order (the turn advances only on a tie). Index −1 when nothing scores
    above −inf."""
    n = score.shape[0]
    best = -np.inf
    for p in range(n):
        if score[p] > best:
            best = score[p]
    if best == -np.inf:
        return -1, turn
    floor = best - 1e-9 * max(1.0, abs(best))
    tied = 0
    least = np.inf
    for p in range(n):
        if score[p] >= floor:
            tied += 1
            if load[p] < least:
                least = load[p]
    if tied == 1:
        for p in range(n):
            if score[p] >= floor:
                return p, turn
    turn += 1
    count = 0
    for p in range(n):
        if score[p] >= floor and load[p] == least:
            count += 1
    want = turn % count
    for p in range(n):
        if score[p] >= floor and load[p] == least:
            if want == 0:
                return p, turn
            want -= 1
    return -1, turn  # unreachable


def _choose(clusters: IntArray, tokens: FloatArray, indptr: Int32Array, holders: Int32Array, base: float,
            sent_items: IntArray, sent_pods: IntArray, healthy: BoolArray, healthy_count: int, active: IntArray,
            inflight: FloatArray, load_penalty: float, backlog: FloatArray, rate: FloatArray, at: FloatArray,
            now: float, fixed_work: float, cached_saving: float, scratch: Int32Array,
            turn: int) -> tuple[int, int, float]:  # pragma: no cover - compiled
    """The affinity decision after the lookup: (pod index or −1, turn, the chosen pod's held tokens) —
    exactly :func:`_held_tokens`, :func:`_recent_credit`, :func:`_affinity_scores` and :func:`_best`
    over every pod (the dense specification), without touching every pod.

    Only the pods the request can tell apart are priced one by one: the holders of its clusters, the
    pods it was recently sent to, and the ``active`` pods (in flight or with a backlog). Every other
    healthy pod holds nothing of the request, has an empty backlog and nothing in flight, so its score
    is one number shared by all of them ("plain" pods): they enter the maximum once, the ties by
    count, and the turn-taking by a walk over the pod index that stops at the chosen one. A decision
    at a thousand pods then reads a few dozen pods' state instead of five arrays of a thousand — what
    a decision costs when the caches are cold between two requests (docs/gateway-api.md).
    ``scratch``: −1 for every pod on entry, and again on return (the pod → slot map of the priced pods).
    The backlog's clock must not run backwards (an idle pod's backlog is then exactly 0 at ``now``)."""
    pods = healthy.shape[0]
    known = indptr.shape[0] - 1
    same = tokens.shape[0] == 1
    room = active.shape[0] + sent_items.shape[0]
    for i in range(clusters.shape[0]):
        c = clusters[i]
        if 0 <= c < known:
            room += indptr[c + 1] - indptr[c]
    slot_pod = np.empty(room, dtype=np.int64)
    held = np.zeros(room, dtype=np.float64)
    recent = np.zeros(room, dtype=np.float64)
    slots = 0
    for i in range(clusters.shape[0]):  # item order: each pod's sum in the dense order
        c = clusters[i]
        if c < 0 or c >= known:
            continue
        t = tokens[0] if same else tokens[i]
        for q in range(indptr[c], indptr[c + 1]):
            p = holders[q]
            if scratch[p] < 0:
                scratch[p], slot_pod[slots] = slots, p
                slots += 1
            held[scratch[p]] += t
    credited = sent_items.shape[0] > 0
    for e in range(sent_items.shape[0]):
        k, p = sent_items[e], sent_pods[e]
        if not holds(indptr, holders, clusters[k], p):
            if scratch[p] < 0:
                scratch[p], slot_pod[slots] = slots, p
                slots += 1
            recent[scratch[p]] += tokens[0] if same else tokens[k]
    for a in range(active.shape[0]):
        p = active[a]
        if scratch[p] < 0:
            scratch[p], slot_pod[slots] = slots, p
            slots += 1
    plain_held = 0.0
    if base != 0.0:
        plain_held += base
        for s in range(slots):
            held[s] += base

    priced = backlog.shape[0] > 0
    score = np.empty(slots, dtype=np.float64)
    top = -np.inf
    priced_healthy = 0
    for s in range(slots):
        p = slot_pod[s]
        if not healthy[p]:
            score[s] = -np.inf
            continue
        priced_healthy += 1
        cached = held[s] + recent[s] if credited else held[s]
        if priced:
            score[s] = -pod_cost(backlog[p], rate[p], at[p], now, fixed_work, cached_saving, cached)
        else:
            score[s] = cached - load_penalty * inflight[p]
        top = max(top, score[s])
    plain = healthy_count - priced_healthy
    plain_cached = plain_held + 0.0 if credited else plain_held
    if priced:
        plain_score = -pod_cost(0.0, 0.0, 0.0, 0.0, fixed_work, cached_saving, plain_cached)
    else:
        plain_score = plain_cached - load_penalty * 0.0
    if plain > 0:
        top = max(top, plain_score)

    chosen = -1
    if top > -np.inf:
        floor = top - 1e-9 * max(1.0, abs(top))
        plain_tied = plain > 0 and plain_score >= floor
        tied = plain if plain_tied else 0
        least = 0.0 if plain_tied else np.inf
        for s in range(slots):
            if score[s] >= floor:
                tied += 1
                chosen = slot_pod[s]
                least = min(least, inflight[slot_pod[s]])
        if tied > 1 or plain_tied:
            plain_in = plain_tied and least == 0.0
            if tied > 1:
                turn += 1
                count = plain if plain_in else 0
                for s in range(slots):
                    if score[s] >= floor and inflight[slot_pod[s]] == least:
                        count += 1
                want = turn % count
            else:
                want = 0  # the one plain pod
            for p in range(pods):  # the want-th member of the final tie, in pod order
                s = scratch[p]
                member = (score[s] >= floor and inflight[p] == least) if s >= 0 else (plain_in and healthy[p])
                if member:
                    if want == 0:
                        chosen = p
                        break
                    want -= 1
    cached_tokens = 0.0
    if chosen >= 0:
        cached_tokens = held[scratch[chosen]] if scratch[chosen] >= 0 else plain_held
    for s in range(slots):
        scratch[slot_pod[s]] = -1
    return chosen, turn, cached_tokens


def _look_up_and_choose(hashes: IntArray, directory: Any, keys: UIntArray, values: Any, shift: np.uint64, width: int,
                        tokens: FloatArray, indptr: Int32Array, holders: Int32Array, base: float, sent_items: IntArray,
                        sent_pods: IntArray, healthy: BoolArray, healthy_count: int, active: IntArray,
                        inflight: FloatArray, load_penalty: float, backlog: FloatArray, rate: FloatArray,
                        at: FloatArray, now: float, fixed_work: float, cached_saving: float, scratch: Int32Array,
                        turn: int) -> tuple[int, int, float, IntArray]:  # pragma: no cover - compiled
    """:func:`_probe` then :func:`_choose` in one call (each call from Python costs a few µs when the
    caches are cold, as they are between two requests): (pod index or −1, turn, its held tokens,
    clusters)."""
    clusters = probe(hashes, directory, keys, values, shift, width)
    chosen, turn, held = choose(clusters, tokens, indptr, holders, base, sent_items, sent_pods, healthy, healthy_count,
                                active, inflight, load_penalty, backlog, rate, at, now, fixed_work, cached_saving,
                                scratch, turn)
    return chosen, turn, held, clusters


probe = njit(nogil=True)(_probe)
held_tokens = njit(nogil=True)(_held_tokens)
recent_credit = njit(nogil=True)(_recent_credit)
holds = njit(nogil=True, inline="always")(_holds)
pod_cost = njit(nogil=True, inline="always")(_pod_cost)
backlog_cost = njit(nogil=True)(_backlog_cost)
affinity_scores = njit(nogil=True)(_affinity_scores)
best = njit(nogil=True)(_best)
choose = njit(nogil=True)(_choose)
look_up_and_choose = njit(nogil=True)(_look_up_and_choose)

NOTHING = np.zeros(0)
"""The empty array that stands for "no such term" (no recent credit, no backlog)."""
NO_ENTRIES = np.zeros(0, dtype=np.int64)
"""No items sent lately (:func:`_recent_credit`'s entries)."""


def warm() -> None:
    """Compile every kernel for the argument types the router passes (the item index's own dtypes are
    compiled by :class:`~kvshard_router.snapshot.ItemIndex` when it is built)."""
    f, i32, ok, one = np.zeros(1), np.zeros(2, dtype=np.int32), np.ones(1, dtype=np.bool_), np.zeros(1, dtype=np.int64)
    backlog_cost(f, f, f, 0.0, 0.0, 0.0, f)
    affinity_scores(f, f, ok, f, 0.0, f, f, f, 0.0, 0.0, 0.0)
    best(f, f, 0)
    recent_credit(one, f, i32, i32, 1, one, one)
    for sent in (NO_ENTRIES, one):
        choose(one, f, i32, i32, 0.0, sent, sent, ok, 1, one, f, 0.0, f, f, f, 0.0, 0.0, 0.0,
               np.full(1, -1, dtype=np.int32), 0)


def warm_index(directory: Any, keys: UIntArray, values: Any, shift: np.uint64, width: int) -> None:
    """Compile the probe and the fused decision for an item index's array types."""
    f, ok, one = np.zeros(1), np.ones(1, dtype=np.bool_), np.zeros(1, dtype=np.int64)
    i32 = np.zeros(2, dtype=np.int32)
    probe(NO_ENTRIES, directory, keys, values, shift, width)
    for sent in (NO_ENTRIES, one):
        look_up_and_choose(NO_ENTRIES, directory, keys, values, shift, width, f, i32, i32, 0.0, sent, sent, ok, 1, one,
                           f, 0.0, f, f, f, 0.0, 0.0, 0.0, np.full(1, -1, dtype=np.int32), 0)
