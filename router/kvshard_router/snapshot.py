"""An immutable, array-backed routing snapshot: what the router knows about placement at one instant.

The router answers one question per request — *which pods hold the blocks of these items?* — and it
must answer it in microseconds for catalogs of 10 M items and 1,000 pods. The decoded
:class:`~kvshard.placement_schema.Placement` (a dict of 10 M strings, ~1 GB) is the wrong shape for
that, so a snapshot re-packs it once per generation:

* :class:`ItemIndex` — item id → cluster as a sorted ``uint64`` array of item-id hashes, a parallel
  ``int16``/``int32`` cluster array and a bucket directory (≈ 10.9 bytes per item: **≈ 109 MB for
  10 M items with fewer than 32,767 clusters, ≈ 129 MB otherwise**; building needs ~250 MB more for
  a few seconds). A batch lookup is one compiled probe (:mod:`kvshard_router.kernels`). The hash
  is Python's ``hash(str)``: salted per process, which is fine because the index never leaves the
  process (pickling is refused). Items whose hashes collide are kept exactly in a small dict; an
  *unknown* item can alias a known one only with probability ≈ n / 2⁶⁴ (≈ 5·10⁻¹³ at 10 M items), in
  which case it is merely routed as if it were that item.
* cluster → holder pods in CSR form (``indptr``/``holders`` ``int32`` arrays). Only pods that
  **reported the cluster warm** count as holders (make-before-break: a new replica attracts traffic
  only once its sidecar says the blocks are there, and an old holder keeps its traffic until it has
  evicted and re-reported). A cluster no pod has warmed yet falls back to its assigned pods, since
  they are the ones that will compute and keep its blocks.
* pod health as a boolean mask; :meth:`Snapshot.with_health` swaps it without copying the big arrays.

Live load is deliberately *not* here: it changes per request and lives in a
:class:`~kvshard_router.policies.LoadView`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from kvshard.placement_schema import Placement, WarmReport
from kvshard_router import kernels
from kvshard_router.kernels import UNKNOWN, BoolArray, FloatArray, Int32Array, IntArray, UIntArray

__all__ = ["UNKNOWN", "BoolArray", "FloatArray", "Int32Array", "IntArray", "ItemIndex", "PodStatus", "Probe",
           "Snapshot", "UIntArray", "build_snapshot", "item_token_array", "warm_from_reports"]


def _hashes(ids: Iterable[str], count: int) -> UIntArray:
    return np.fromiter(map(hash, ids), dtype=np.int64, count=count).view(np.uint64)


Probe = tuple[IntArray, npt.NDArray[Any], UIntArray, npt.NDArray[Any], np.uint64, int]
"""A batch of id hashes and an :class:`ItemIndex`'s arrays: what the compiled probe takes (hashes,
directory, keys, values, shift, width; a plain tuple, built per request)."""


def item_token_array(tokens: npt.ArrayLike, items: int) -> FloatArray:
    """Block sizes of ``items`` items as the kernels take them: one per item, or one for all."""
    array = np.array(tokens, dtype=np.float64, ndmin=1)
    if array.ndim != 1 or (len(array) != 1 and len(array) != items):
        raise ValueError(f"{len(array)} token counts for {items} items")
    return array


class ItemIndex:
    """Item id → cluster id for millions of items in flat arrays.

    Keys are the items' 64-bit string hashes, sorted; a directory of bucket offsets (bucket = the top
    bits of the hash, ~8 keys per bucket) turns a lookup into one directory read plus one short
    contiguous scan. A plain binary search over 10 M keys costs ~23 cache misses per item — ~100 µs
    for a 50-candidate request — where this costs about three.

    >>> index = ItemIndex.from_mapping({"a": 3, "b": 7})
    >>> index.lookup(["b", "zzz", "a"]).tolist()
    [7, -1, 3]
    """

    __slots__ = ("_collisions", "_directory", "_keys", "_n", "_shift", "_values", "_width")

    def __init__(
        self, keys: UIntArray, values: npt.NDArray[np.signedinteger[Any]], collisions: dict[str, int]
    ) -> None:
        self._n = len(keys)
        self._collisions = collisions
        bits = max(1, int(len(keys) // 8).bit_length())
        self._shift = np.uint64(64 - bits)
        counts = np.bincount((keys >> self._shift).astype(np.int64), minlength=1 << bits)
        self._directory = np.zeros((1 << bits) + 1, dtype=np.int64 if len(keys) >= 2**31 else np.int32)
        np.cumsum(counts, out=self._directory[1:])
        width = max(1, int(counts.max(initial=0)))
        # One window's worth of padding past the end, so a lookup needs no bounds clamp: the pad keys
        # (all ones) can only match a hash of all ones the index lacks, and their values say UNKNOWN.
        self._keys = np.concatenate([keys, np.full(width, np.iinfo(np.uint64).max, dtype=np.uint64)])
        self._values = np.concatenate([values, np.full(width, UNKNOWN, dtype=values.dtype)])
        self._width = width
        # compiles the probe for these arrays' dtypes now, not on a request's path
        kernels.warm_index(self._directory, self._keys, self._values, self._shift, width)

    @classmethod
    def from_mapping(cls, item_clusters: Mapping[str, int]) -> ItemIndex:
        """Index a decoded placement's ``item_clusters``."""
        values = np.fromiter(item_clusters.values(), dtype=np.int64, count=len(item_clusters))
        return cls.from_items(_KeysView(item_clusters), values)

    @classmethod
    def from_items(cls, ids: Sequence[str], clusters: npt.ArrayLike) -> ItemIndex:
        """Index parallel sequences (``ids`` is only iterated, at most twice, so it may be lazy)."""
        labels = np.asarray(clusters, dtype=np.int64)
        n = len(ids)
        if labels.shape != (n,):
            raise ValueError(f"{n} ids but {labels.shape} clusters")
        if n and int(labels.min()) < 0:
            raise ValueError("cluster ids must be non-negative")
        dtype: type[np.signedinteger[Any]] = (
            np.int16 if n == 0 or int(labels.max()) < np.iinfo(np.int16).max else np.int32
        )
        keys = _hashes(ids, n)
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        values: npt.NDArray[np.signedinteger[Any]] = labels[order].astype(dtype)
        del order
        collisions: dict[str, int] = {}
        same = np.flatnonzero(keys[1:] == keys[:-1])
        if len(same):  # rare: resolve colliding hashes exactly by id, drop them from the arrays
            bad = np.unique(keys[same])
            rows = set(np.flatnonzero(np.isin(_hashes(ids, n), bad)).tolist())
            for row, item in enumerate(ids):
                if row in rows:
                    collisions[item] = int(labels[row])
            keep = ~np.isin(keys, bad)
            keys, values = keys[keep], values[keep]
        return cls(keys, values, collisions)

    def __len__(self) -> int:
        return self._n + len(self._collisions)

    @property
    def nbytes(self) -> int:
        """Bytes held by the index arrays (the dict of collisions is almost always empty)."""
        arrays = (self._keys, self._values, self._directory)
        return sum(int(a.nbytes) for a in arrays) + 100 * len(self._collisions)

    def lookup(self, ids: Sequence[str]) -> IntArray:
        """Cluster of each id, :data:`UNKNOWN` (−1) for ids not in the placement."""
        out: IntArray = kernels.probe(*self.probe(ids))
        if self._collisions:
            self.resolve_collisions(ids, out)
        return out

    def probe(self, ids: Sequence[str]) -> Probe:
        """The compiled probe's arguments for ``ids`` (:func:`kvshard_router.kernels.probe`): every lookup
        goes through here, whether :meth:`lookup` or a decision that probes inside its own kernel."""
        hashes = np.fromiter(map(hash, ids), dtype=np.int64, count=len(ids))
        return hashes, self._directory, self._keys, self._values, self._shift, self._width

    @property
    def exact_by_probe(self) -> bool:
        """Whether the probe alone gives every cluster (no two ids share a hash: the usual case)."""
        return not self._collisions

    def resolve_collisions(self, ids: Sequence[str], clusters: IntArray) -> None:
        """Set the clusters of ``ids`` whose hashes collide (kept by id, outside the arrays) in place."""
        for j, item in enumerate(ids):
            cluster = self._collisions.get(item)
            if cluster is not None:
                clusters[j] = cluster

    def get(self, item: str) -> int | None:
        """One item's cluster, or None."""
        cluster = int(self.lookup([item])[0])
        return None if cluster == UNKNOWN else cluster

    def __reduce__(self) -> NoReturn:
        raise TypeError("ItemIndex uses per-process string hashes and cannot be pickled; rebuild it")


class _KeysView(Sequence[str]):
    """A mapping's keys as a sequence without copying them into a list (10 M strings is ~80 MB of
    pointers we do not need)."""

    def __init__(self, mapping: Mapping[str, int]) -> None:
        self._mapping = mapping

    def __len__(self) -> int:
        return len(self._mapping)

    def __iter__(self) -> Any:
        return iter(self._mapping)

    def __getitem__(self, index: Any) -> Any:  # only iteration is used
        raise TypeError("sequential access only")


@dataclasses.dataclass(frozen=True)
class PodStatus:
    """What the router's health checks concluded about one pod."""

    name: str
    healthy: bool = True


@dataclasses.dataclass(frozen=True, eq=False)
class Snapshot:
    """One placement generation, the warm sets and pod health, packed for per-request scoring.

    Build it with :func:`build_snapshot`; never mutate the arrays (they are shared between snapshots).
    """

    generation: int
    pods: tuple[str, ...]
    healthy: BoolArray
    items: ItemIndex
    indptr: Int32Array
    """CSR row pointers: holders of cluster ``c`` are ``holders[indptr[c]:indptr[c + 1]]``."""
    holders: Int32Array
    assigned_indptr: Int32Array
    assigned: Int32Array
    history_everywhere: bool = True
    default_item_tokens: int = 16
    pod_index: Mapping[str, int] = dataclasses.field(default_factory=dict)
    healthy_indices: Int32Array = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int32))

    @property
    def clusters(self) -> int:
        return len(self.indptr) - 1

    @property
    def nbytes(self) -> int:
        """Bytes of every array the snapshot holds (items dominate)."""
        arrays = (self.healthy, self.indptr, self.holders, self.assigned_indptr, self.assigned, self.healthy_indices)
        return self.items.nbytes + sum(int(a.nbytes) for a in arrays)

    def clusters_of(self, items: Sequence[str]) -> IntArray:
        """Cluster of each item (−1 unknown)."""
        return self.items.lookup(items)

    def holders_of(self, cluster: int) -> tuple[str, ...]:
        """Pods that count as holding ``cluster`` for routing (warm ones; assigned ones if none is)."""
        if not 0 <= cluster < self.clusters:
            return ()
        return tuple(self.pods[j] for j in self.holders[self.indptr[cluster] : self.indptr[cluster + 1]])

    def cached_tokens(self, clusters: IntArray, tokens: npt.ArrayLike, base: float = 0.0) -> FloatArray:
        """Per pod: ``base`` + Σ ``tokens[j]`` over items ``j`` whose cluster the pod holds (item blocks
        only; ``tokens`` one per item or one for all); ``clusters`` as :meth:`clusters_of` gives them
        (−1 for unknown)."""
        clusters = np.asarray(clusters, dtype=np.int64)
        held: FloatArray = kernels.held_tokens(clusters, item_token_array(tokens, len(clusters)), self.indptr,
                                               self.holders, len(self.pods), float(base))
        return held

    def with_health(self, health: Mapping[str, bool]) -> Snapshot:
        """The same placement with new health (pods not named keep their state); arrays are shared."""
        mask = self.healthy.copy()
        for pod, ok in health.items():
            j = self.pod_index.get(pod)
            if j is not None:
                mask[j] = ok
        return dataclasses.replace(self, healthy=mask, healthy_indices=np.flatnonzero(mask).astype(np.int32))

    def restricted_to(self, pods: Iterable[str]) -> Snapshot:
        """The same snapshot with every pod outside ``pods`` unhealthy (the GIE subset hint): what
        ``with_health({p: False for p not in pods})`` gives, in a few array operations instead of a
        Python pass over every pod — per request at a thousand pods that pass cost more than the decision."""
        mask = np.zeros(len(self.pods), dtype=np.bool_)
        mask[[j for p in pods if (j := self.pod_index.get(p)) is not None]] = True
        mask &= self.healthy
        return dataclasses.replace(self, healthy=mask, healthy_indices=np.flatnonzero(mask).astype(np.int32))


def _csr(rows: Sequence[Sequence[int]]) -> tuple[Int32Array, Int32Array]:
    lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    indptr = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lens, out=indptr[1:])
    flat = np.fromiter((j for r in rows for j in r), dtype=np.int32, count=int(lens.sum()))
    return indptr, flat


def warm_from_reports(reports: Mapping[str, WarmReport]) -> dict[str, frozenset[int]]:
    """``EtcdStore.read_warm`` output (pod → report) as pod → warm clusters.

    The generation is not filtered on: blocks warmed for an older generation are still in the pod's
    store until the sidecar evicts them and re-reports, so they still serve hits.
    """
    return {pod: frozenset(report.clusters) for pod, report in reports.items()}


def build_snapshot(
    placement: Placement,
    warm: Mapping[str, Iterable[int]],
    health: Mapping[str, bool] | Iterable[PodStatus] = (),
    *,
    items: ItemIndex | None = None,
    default_item_tokens: int = 16,
    default_healthy: bool = True,
) -> Snapshot:
    """Pack ``placement`` with the pods' warm sets and health into a :class:`Snapshot`.

    ``items`` reuses an index from an earlier generation whose ``item_clusters`` did not change (the
    common case: rebalancing only changes the assignment). Pods are ``placement.pods`` plus every
    assigned or health-checked pod; warm reports from other pods are ignored (they left the placement).
    """
    status = {s.name: s.healthy for s in health} if not isinstance(health, Mapping) else dict(health)
    names = set(placement.pods) | {p for h in placement.assignment.values() for p in h} | set(status)
    pods = tuple(sorted(names))
    index = {p: j for j, p in enumerate(pods)}
    item_index = items if items is not None else ItemIndex.from_mapping(placement.item_clusters)
    max_item_cluster = max(placement.item_clusters.values(), default=-1) if items is None else -1
    n_clusters = max(max(placement.assignment, default=-1), max_item_cluster) + 1
    if any(c < 0 for c in placement.assignment):
        raise ValueError("cluster ids must be non-negative")

    warm_by_cluster: list[list[int]] = [[] for _ in range(n_clusters)]
    for pod in pods:
        for c in sorted(set(warm.get(pod, ()))):
            if 0 <= c < n_clusters:
                warm_by_cluster[c].append(index[pod])
    assigned_rows: list[list[int]] = [[] for _ in range(n_clusters)]
    for c, holders in placement.assignment.items():
        assigned_rows[c] = [index[p] for p in dict.fromkeys(holders)]
    # Warm holders that are assigned come first (best first, as placement lists them).
    holder_rows = []
    for c in range(n_clusters):
        warm_set = set(warm_by_cluster[c])
        if warm_set:
            first = [j for j in assigned_rows[c] if j in warm_set]
            holder_rows.append(first + sorted(warm_set - set(first)))
        else:
            holder_rows.append(assigned_rows[c])
    indptr, flat = _csr(holder_rows)
    a_indptr, a_flat = _csr(assigned_rows)
    mask = np.array([status.get(p, default_healthy) for p in pods], dtype=np.bool_)
    kernels.warm()  # compiled once per process, here rather than on the first request
    return Snapshot(
        generation=placement.generation,
        pods=pods,
        healthy=mask,
        items=item_index,
        indptr=indptr,
        holders=flat,
        assigned_indptr=a_indptr,
        assigned=a_flat,
        history_everywhere=placement.history_policy == "ReplicateAll",
        default_item_tokens=default_item_tokens,
        pod_index=index,
        healthy_indices=np.flatnonzero(mask).astype(np.int32),
    )
