"""The item blocks the router recently sent each pod outside its placement (pure).

A pod serves a candidate its placement does not give it by computing (or fetching) the block, and
its sidecar keeps that block in its memory tier, least recently used first out. So after the router
sends a pod a request, the pod holds that request's blocks for a while, whatever the placement says.
The router saw every request it sent, so it can keep the same list per pod, bounded like the pod's
cache, and count those blocks as cached there — SGLang's router keeps an approximate radix tree of
each worker's cache from the requests it routed for the same reason. Popular items are in many
pods' lists; an item asked for once stays until ``per_pod`` newer ones push it out.

The list is an estimate: a pod whose cache is smaller than ``per_pod`` or that restarted holds less
than the router counts (a pod that leaves the placement is forgotten). That costs some locality,
never an answer (a missing block is computed). Blocks the placement gives the pod are not recorded
and not counted twice; and when a new placement gives a pod a cluster, its entries of that cluster
are dropped, because the sidecar keeps those blocks as the cluster's from then on and evicts them all
when the cluster moves away — kept, they would count again then, for blocks the pod no longer has
(a scale-in gives the leaving pod's clusters to the others, the scale-out after it takes them back).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvshard_router import kernels
from kvshard_router.snapshot import FloatArray, Int32Array, IntArray, Snapshot, item_token_array


class RecentBlocks:
    """Per pod, the last ``per_pod`` item blocks sent to it that its placement does not hold."""

    def __init__(self, per_pod: int) -> None:
        if per_pod < 1:
            raise ValueError("per_pod must be >= 1")
        self.per_pod = per_pod
        self._lists: dict[str, collections.OrderedDict[str, None]] = collections.defaultdict(collections.OrderedDict)
        self._pods_of: dict[str, tuple[str, ...]] = {}
        """Item → pods whose list holds it (tuples of strings: the garbage collector stops tracking them,
        so a large table adds no collector pauses to decisions)."""
        self._placed_for: Snapshot | None = None
        self._pods_for: tuple[str, ...] | None = None
        self._holders_for: Int32Array | None = None
        self._placed_sets: list[frozenset[int]] = []

    def __len__(self) -> int:
        return sum(len(blocks) for blocks in self._lists.values())

    def _placed(self, snapshot: Snapshot) -> list[frozenset[int]]:
        """Per cluster, the pod indices holding it in ``snapshot`` (built once per snapshot: a Python
        set test per item is what keeps a 20-candidate decision in microseconds)."""
        if snapshot is not self._placed_for:
            if snapshot.pods is not self._pods_for:  # a pod that left the placement starts over if it returns
                for gone in [p for p in self._lists if p not in snapshot.pod_index]:
                    self.forget(gone)
                self._pods_for = snapshot.pods
            if snapshot.holders is not self._holders_for:  # a new placement or warm set, not only health
                indptr, holders = snapshot.indptr.tolist(), snapshot.holders.tolist()
                self._placed_sets = [frozenset(holders[indptr[c]:indptr[c + 1]]) for c in range(snapshot.clusters)]
                self._holders_for = snapshot.holders
                self._drop_placed(snapshot)
            self._placed_for = snapshot
        return self._placed_sets

    def _drop_placed(self, snapshot: Snapshot) -> None:
        """Drop each pod's entries of clusters the placement now gives it (the module's docstring says why)."""
        placed, known, index = self._placed_sets, snapshot.clusters, snapshot.pod_index
        for pod, blocks in self._lists.items():
            j = index.get(pod)
            if j is None or not blocks:
                continue
            items = list(blocks)
            for item, cluster in zip(items, snapshot.clusters_of(items).tolist(), strict=True):
                if 0 <= cluster < known and j in placed[cluster]:
                    del blocks[item]
                    self._drop(item, pod)

    def record(self, pod: str, items: Sequence[str], clusters: IntArray, snapshot: Snapshot) -> None:
        """``pod`` was sent ``items`` (their clusters in ``snapshot``): remember those it does not hold
        by placement, newest last, dropping the oldest beyond ``per_pod``."""
        j = snapshot.pod_index.get(pod, -1)
        placed, known = self._placed(snapshot), snapshot.clusters
        blocks, pods_of, limit = self._lists[pod], self._pods_of, self.per_pod
        for item, cluster in zip(items, clusters.tolist(), strict=True):
            if 0 <= cluster < known and j in placed[cluster]:
                continue
            if item in blocks:
                blocks.move_to_end(item)
                continue
            blocks[item] = None
            pods_of[item] = (*pods_of[item], pod) if item in pods_of else (pod,)
            if len(blocks) > limit:
                self._drop(blocks.popitem(last=False)[0], pod)

    def held_tokens(self, items: Sequence[str], clusters: IntArray, tokens: npt.ArrayLike,
                    snapshot: Snapshot) -> FloatArray:
        """Per snapshot pod: tokens of ``items`` it holds from recent requests, not by placement."""
        credit = self.credit(items, clusters, tokens, snapshot)
        return np.zeros(len(snapshot.pods), dtype=np.float64) if credit is None else credit

    def credit(self, items: Sequence[str], clusters: IntArray, tokens: npt.ArrayLike,
               snapshot: Snapshot) -> FloatArray | None:
        """:meth:`held_tokens`, or None when no pod was sent any of ``items`` lately (the usual case at
        a large catalog: the caller then skips an array of zeros and an addition per decision)."""
        sent = self.sent(items, snapshot)
        if sent is None:
            return None
        credit: FloatArray = kernels.recent_credit(
            np.asarray(clusters, dtype=np.int64), item_token_array(tokens, len(items)), snapshot.indptr,
            snapshot.holders, len(snapshot.pods), *sent)
        return credit

    def sent(self, items: Sequence[str], snapshot: Snapshot) -> tuple[IntArray, IntArray] | None:
        """Which of ``items`` (positions) went to which snapshot pods lately, as parallel arrays in item
        order, or None for none: what :func:`kvshard_router.kernels.recent_credit` counts (it leaves out
        the pods that hold an item's cluster by placement)."""
        if not self._pods_of:
            return None
        sent = list(map(self._pods_of.get, items))  # C-speed dict probes: most items were sent nowhere
        if not any(sent):
            return None
        self._placed(snapshot)  # keeps the lists in step with the snapshot's pods and placement
        index = snapshot.pod_index
        positions, pods = [], []
        for k, names in enumerate(sent):
            for pod in names or ():
                j = index.get(pod)
                if j is not None:
                    positions.append(k)
                    pods.append(j)
        return np.array(positions, dtype=np.int64), np.array(pods, dtype=np.int64)

    def _drop(self, item: str, pod: str) -> None:
        holders = self._pods_of.get(item, ())
        if len(holders) <= 1:  # the usual case: no other pod was sent it lately
            self._pods_of.pop(item, None)
        else:
            self._pods_of[item] = tuple(p for p in holders if p != pod)

    def forget(self, pod: str) -> None:
        """Drop a pod's list (it left, or restarted with an empty cache)."""
        for item in self._lists.pop(pod, {}):
            self._drop(item, pod)
