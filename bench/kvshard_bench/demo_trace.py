"""The request stream of ``kvshard demo``: MovieLens sessions as a retrieval stage would send them.

Why this shape. kvshard only pays off when prompts repeat *blocks* without repeating *prefixes*, and
when item blocks that show up together live on the same pod. Real traffic has both properties: a
user's history is the same in every one of their requests, and a retrieval stage proposes items that
are near the user's recent ones in some embedding space. So the demo:

* samples ``users`` MovieLens users; each keeps one fixed history (their ``history`` items before a
  cut point) for all their requests, so history blocks repeat, and each request's *target* is one of
  the items they actually rated next;
* draws the other candidates, Zipf-skewed by popularity (weight ∝ 1/rank^``zipf``, rank by rating
  count), from the nearest neighbours of the user's five most recent items **in the operator's own
  vector space** — the MiniLM embeddings the operator clusters (same catalog order, so the on-disk
  embedding cache is shared), pulled ``cooccurrence_percent`` % towards co-occurring items with
  :func:`kvshard_operator.placement.pull_cooccurring`, as the local cluster's operator does. The
  candidates are therefore cluster-coherent, as retrieval output is;
* during a *hot-shard burst* a ``share`` of requests take their candidates from a given hot pool
  (the items of one or two clusters, chosen from the live placement by :func:`pick_hot_clusters`).

With ``candidate_set = "retrieval"`` (``kvshard demo --candidate-set retrieval``, the default) a session
request's candidates are instead what a retrieval stage hands an LLM reranker
(:mod:`kvshard.retrieval`: item-kNN of the session's history over the *training* users, topped up with
popular items), excluding everything the user interacted with before the target. The target is among
them only when the stage retrieved it — never inserted — so the demo's quality table can put the
served model beside the stage's own order, the bar a reranker must clear. Sessions then come from users
the retrieval statistics never counted (held-out users), so no target shaped its own candidates.
Burst requests keep their hot-pool candidates (the target inserted): they are load, not quality.

Users' sessions are interleaved by a seeded shuffle that keeps each user's order; the stream wraps
around (with fresh candidate draws) when a phase needs more requests than the sessions hold, because
the burst lasts until the operator rebalances, which is not known in advance. Everything is seeded:
the same calls give the same requests. Pure (numpy and the core's retrieval stage): no I/O, no model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvshard.datasets import Dataset
from kvshard.retrieval import RetrievalIndex
from kvshard_operator import placement as op_placement

CandidateSet = Literal["neighbours", "retrieval"]
CANDIDATE_SETS: tuple[CandidateSet, ...] = ("retrieval", "neighbours")
FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int64]


@dataclasses.dataclass(frozen=True)
class DemoTraceSettings:
    users: int = 40
    requests_per_user: int = 5
    history: int = 20
    candidates: int = 20
    neighbours: int = 40
    recent: int = 5
    zipf: float = 1.0
    cooccurrence_percent: int = 50
    seed: int = 0
    candidate_set: CandidateSet = "neighbours"
    """``neighbours``: the target plus Zipf-sampled embedding neighbours; ``retrieval``: the retrieval
    stage's items (:class:`~kvshard.retrieval.RetrievalIndex`), the target only where retrieved."""

    def __post_init__(self) -> None:
        if self.candidate_set not in CANDIDATE_SETS:
            raise ValueError(f"candidate_set must be one of {', '.join(CANDIDATE_SETS)}, got {self.candidate_set!r}")
        if self.users < 1 or self.requests_per_user < 1 or self.history < 1:
            raise ValueError("users, requests_per_user and history must be at least 1")
        if self.candidates < 2:
            raise ValueError("candidates must be at least 2")


@dataclasses.dataclass(frozen=True)
class DemoRequest:
    """One ``/v1/recommend`` request of the replay."""

    index: int
    user: str
    history: tuple[str, ...]
    candidates: tuple[str, ...]
    target: str
    trending: bool
    retrieval_rank: int | None = None
    """With retrieval-stage candidates: the target's 0-based position in the stage's own order (None:
    the stage did not retrieve it, so it is not among the candidates)."""
    from_retrieval: bool = False
    """Whether the candidates are the retrieval stage's (not a burst's hot pool, not neighbours)."""
    retrieval_scores: tuple[float, ...] | None = None
    """The stage's score of each candidate, in the candidates' order (retrieval-stage requests only)."""

    def body(self, **extra: Any) -> dict[str, Any]:
        """The JSON body (``extra`` adds e.g. ``blend`` or ``max_tokens``); a retrieval-stage request carries
        the stage's scores, which the sidecar fuses into its ranking."""
        body: dict[str, Any] = {"user_id": self.user, "history": list(self.history),
                                "candidates": list(self.candidates)}
        if self.retrieval_scores is not None:
            body["retrieval_scores"] = list(self.retrieval_scores)
        return {**body, **extra}


@dataclasses.dataclass(frozen=True)
class ItemSpace:
    """Catalog rows in the operator's order, their vectors, neighbours and popularity weights."""

    ids: tuple[str, ...]
    row: Mapping[str, int]
    neighbours: IntArray
    """``neighbours[i]``: the rows nearest to row ``i`` (itself excluded), nearest first."""
    weight: npt.NDArray[np.float64]
    """Popularity weight ∝ 1/rank^zipf."""

    @classmethod
    def build(cls, dataset: Dataset, embeddings: FloatArray, settings: DemoTraceSettings,
              ids: Sequence[str] | None = None) -> ItemSpace:
        """``embeddings[i]`` is the vector of ``ids[i]`` (default: sorted item ids, the operator's order)."""
        order = tuple(sorted(dataset.items)) if ids is None else tuple(ids)
        if embeddings.shape[0] != len(order):
            raise ValueError(f"{embeddings.shape[0]} embeddings for {len(order)} items")
        row = {item: j for j, item in enumerate(order)}
        histories = [[row[i] for i in h if i in row] for h in dataset.histories.values()]
        x = op_placement.pull_cooccurring(embeddings, histories, settings.cooccurrence_percent)
        sims = x @ x.T
        np.fill_diagonal(sims, -np.inf)
        k = min(settings.neighbours, len(order) - 1)
        neighbours = np.argsort(-sims, axis=1, kind="stable")[:, :k].astype(np.int64)
        counts = np.bincount([i for h in histories for i in h], minlength=len(order))
        rank = np.empty(len(order), dtype=np.int64)
        rank[np.argsort(-counts, kind="stable")] = np.arange(1, len(order) + 1)
        weight = 1.0 / rank.astype(np.float64) ** settings.zipf
        return cls(order, row, neighbours, weight)


class DemoTrace:
    """The seeded request stream: ``next()`` gives the next request, trending or not. ``retrieval`` is the
    retrieval stage, required with ``candidate_set = "retrieval"``: sessions are then sampled from the
    users it was not fitted on."""

    def __init__(self, dataset: Dataset, space: ItemSpace, settings: DemoTraceSettings,
                 retrieval: RetrievalIndex | None = None) -> None:
        self.space, self.settings = space, settings
        if settings.candidate_set == "retrieval" and retrieval is None:
            raise ValueError("retrieval-stage candidates need a retrieval index")
        self.retrieval = retrieval if settings.candidate_set == "retrieval" else None
        self._rng = np.random.default_rng(settings.seed)
        need = settings.history + settings.requests_per_user
        fitted = self.retrieval.users if self.retrieval is not None else frozenset()
        eligible = sorted((u for u, h in dataset.histories.items() if len(h) >= need and u not in fitted),
                          key=_natural)
        if not eligible:
            raise ValueError(f"no user has {need} interactions"
                             + (" outside the retrieval statistics" if fitted else ""))
        users = self._rng.choice(len(eligible), size=min(settings.users, len(eligible)), replace=False)
        self.sessions: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        self._earlier: dict[str, tuple[str, ...]] = {}
        """Each user's interactions before the session (beyond its history): the retrieval stage excludes them."""
        for j in sorted(users.tolist()):
            user = eligible[j]
            items = dataset.histories[user]
            cut = len(items) - settings.requests_per_user
            self.sessions[user] = (tuple(items[cut - settings.history : cut]), tuple(items[cut:]))
            self._earlier[user] = tuple(items[:cut])
        slots = [u for u in self.sessions for _ in range(settings.requests_per_user)]
        self._rng.shuffle(slots)
        self._events: list[tuple[str, int]] = []
        seen: dict[str, int] = {}
        for user in slots:  # the k-th appearance of a user is their k-th request: order kept
            self._events.append((user, seen.get(user, 0)))
            seen[user] = seen.get(user, 0) + 1
        self._next = 0

    def __len__(self) -> int:
        """Requests in one pass over the sampled sessions."""
        return len(self._events)

    def next(self, hot_pool: Sequence[str] = (), share: float = 0.0) -> DemoRequest:
        """The next session request; with probability ``share`` its candidates come from ``hot_pool``."""
        user, k = self._events[self._next % len(self._events)]
        index = self._next
        self._next += 1
        history, targets = self.sessions[user]
        target = targets[k]
        row = self.space.row
        exclude = {row[i] for i in (*history, target) if i in row}
        trending = bool(hot_pool) and float(self._rng.random()) < share
        if not trending and self.retrieval is not None:
            return self._retrieved(index, user, history, (*self._earlier[user], *targets[:k]), target)
        if trending:
            pool = np.array(sorted({row[i] for i in hot_pool if i in row}), dtype=np.int64)
        else:
            recent = [row[i] for i in history[-self.settings.recent :] if i in row]
            pool = np.unique(self.space.neighbours[recent].ravel()) if recent else np.arange(len(row))
        want = self.settings.candidates - 1
        picks = self._sample(pool, exclude, want)
        if len(picks) < want:  # a thin neighbourhood: fill with popular items from the whole catalog
            picks += self._sample(np.arange(len(row), dtype=np.int64), exclude | set(picks), want - len(picks))
        chosen = [target, *(self.space.ids[p] for p in picks)]
        self._rng.shuffle(chosen)
        return DemoRequest(index, user, history, tuple(chosen), target, trending)

    def _retrieved(self, index: int, user: str, history: tuple[str, ...], past: tuple[str, ...],
                   target: str) -> DemoRequest:
        """The retrieval stage's candidates for ``history``, excluding the user's ``past`` (everything
        before the target: earlier items and the session's earlier targets), in a seeded shuffle; the
        target is only looked up in the result."""
        assert self.retrieval is not None
        found = self.retrieval.retrieve(history, self.settings.candidates, exclude=past)
        order = [r.item for r in found]
        shown = list(found)
        self._rng.shuffle(shown)
        rank = order.index(target) if target in order else None
        return DemoRequest(index, user, history, tuple(r.item for r in shown), target, False, rank,
                           from_retrieval=True, retrieval_scores=tuple(r.score for r in shown))

    def _sample(self, pool: IntArray, exclude: set[int], k: int) -> list[int]:
        pool = pool[~np.isin(pool, np.fromiter(exclude, dtype=np.int64, count=len(exclude)))]
        if k <= 0 or not len(pool):
            return []
        p = self.space.weight[pool] / self.space.weight[pool].sum()
        picked: list[int] = self._rng.choice(pool, size=min(k, len(pool)), replace=False, p=p).tolist()
        return picked


def pick_hot_clusters(assignment: Mapping[int, Sequence[str]], item_clusters: Mapping[str, int],
                      count: int = 2) -> tuple[str, list[int]]:
    """The pod to overload and ``count`` of its clusters: the pod holding the most clusters alone
    (ties: first by name), then its largest single-holder clusters. Making one pod hot is what a
    rebalance must fix, so the burst targets clusters that only that pod holds."""
    sizes: dict[int, int] = {}
    for cluster in item_clusters.values():
        sizes[cluster] = sizes.get(cluster, 0) + 1
    sole: dict[str, list[int]] = {}
    for cluster, holders in assignment.items():
        if len(holders) == 1:
            sole.setdefault(holders[0], []).append(cluster)
    if not sole:  # every cluster replicated: fall back to the first holder of each
        for cluster, holders in assignment.items():
            if holders:
                sole.setdefault(holders[0], []).append(cluster)
    if not sole:
        raise ValueError("the placement assigns no cluster to any pod")
    pod = min(sole, key=lambda p: (-len(sole[p]), p))
    clusters = sorted(sole[pod], key=lambda c: (-sizes.get(c, 0), c))[:count]
    return pod, sorted(clusters)


def items_in(item_clusters: Mapping[str, int], clusters: Iterable[int]) -> list[str]:
    """The items of ``clusters``, sorted (the hot pool)."""
    wanted = set(clusters)
    return sorted((i for i, c in item_clusters.items() if c in wanted), key=_natural)


def _natural(text: str) -> tuple[int, str]:
    return (int(text), "") if text.isdigit() else (1 << 62, text)
