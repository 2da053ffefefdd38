"""The retrieval stage in front of the reranker: item-kNN over the history, topped up with popular items.

Why it exists. A production LLM reranker never sees a target hidden among uniformly drawn negatives: a
cheap retrieval stage hands it a short list of items that already look right for the user — neighbours
of what they watched, and popular items — in an order of its own. Against uniform negatives popularity
alone ranks well (``kvshard bench recommender``'s baselines), so a reranker's number there says little;
on retrieval-stage candidates the bar is the retrieval stage's *own order*: a reranker that cannot beat
it adds latency and nothing else. This module is that stage, so the benchmarks and the demo can replay
candidates as a real system would send them.

What it may see. The statistics (item co-occurrence, popularity) are fitted on the histories given to
:class:`RetrievalIndex` and nothing else; :meth:`RetrievalIndex.fit` gives it what
:mod:`kvshard.splits` lets training see — the training users' interactions before their second-to-last
— so no held-out user and no benchmark or validation target is in the counts. A request's candidates
come from its ``history`` (the items the reranker's prompt shows) and exclude everything the user
interacted with before the target (``exclude``): a function of the past only, so nothing the user does
at or after the target shapes them.

The protocol, honestly. A retrieval stage does not always retrieve the target. :func:`retrieval_requests`
keeps the target among the candidates only when the stage retrieved it — it never inserts it; the
benchmark reports the stage's recall@K, and HR@k/NDCG@k over *all* requests with a missed target scoring
0 for every ranking (:func:`quality_or_miss`), beside the same metrics over the requests whose target was
retrieved. The candidates are shown to the reranker in a seeded shuffle, so it cannot copy the stage's
order; the stage's order is the baseline it is compared with.

Pure Python (no numpy, no torch): co-occurrence counts are ``Counter`` updates, fast enough for MovieLens
(a second or two to fit). :class:`kvshard_training.teacher.ItemKnnTeacher` scores candidates with the
same cosine co-occurrence and could reuse this index.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvshard.datasets import Dataset
from kvshard.prompts import RecommendationRequest, position_rng, target_positions
from kvshard.ranking import QUALITY_METRICS, hit_at, ndcg_at
from kvshard.splits import UserSplit

Source = Literal["knn", "popular"]


@dataclass(frozen=True)
class Retrieved:
    """One retrieved item: its retrieval score (summed cosine co-occurrence with the history; 0 for a
    popularity top-up) and which part of the stage found it."""

    item: str
    score: float
    source: Source


class RetrievalIndex:
    """Item co-occurrence and popularity over the given users' histories.

    ``sim(a, b) = |users(a) ∩ users(b)| / sqrt(|users(a)| |users(b)|)`` (cosine over the users who
    interacted with each item); :meth:`retrieve` ranks items by their summed similarity to a history,
    then tops the list up with the most popular items (rating count) the history never co-occurs with.
    ``catalog`` lists every item that may be retrieved (default: the items in ``histories``); catalog
    items nobody in ``histories`` interacted with come last in the popularity order.
    """

    def __init__(self, histories: Mapping[str, Sequence[str]], catalog: Iterable[str] | None = None) -> None:
        self.users: frozenset[str] = frozenset(histories)
        """The users whose interactions are in the counts (a benchmark's users must not be among them)."""
        self._cooc: dict[str, Counter[str]] = {}
        for items in histories.values():
            unique = list(dict.fromkeys(items))
            for item in unique:
                self._cooc.setdefault(item, Counter()).update(unique)  # the diagonal counts the item's users
        known = set(self._cooc) | set(catalog or ())
        self.popular: tuple[str, ...] = tuple(sorted(known, key=lambda i: (-self.count(i), _natural(i))))
        """Every retrievable item, most interacted-with first (ties: natural id order)."""

    @classmethod
    def fit(cls, dataset: Dataset, split: UserSplit) -> RetrievalIndex:
        """The index over what fine-tuning may learn from (:mod:`kvshard.splits`): the training users'
        interactions before their second-to-last; every catalog item is retrievable."""
        users = split.training_users(dataset)
        return cls({u: dataset.histories[u][:-2] for u in users}, dataset.items)

    def count(self, item: str) -> int:
        """Users in the counts who interacted with ``item``."""
        row = self._cooc.get(item)
        return row[item] if row is not None else 0

    def similarity(self, a: str, b: str) -> float:
        """Cosine co-occurrence of ``a`` and ``b`` (0 when either is unknown or they never co-occur)."""
        row = self._cooc.get(a)
        shared = row[b] if row is not None and a != b else 0
        return shared / math.sqrt(self.count(a) * self.count(b)) if shared else 0.0

    def knn_scores(self, history: Sequence[str]) -> dict[str, float]:
        """Every item that co-occurs with the history, with its summed similarity to it (each distinct
        history item counted once, in history order, so the sums are reproducible)."""
        scores: dict[str, float] = {}
        for item in dict.fromkeys(history):
            row = self._cooc.get(item)
            if row is None:
                continue
            norm = row[item]
            for other, shared in row.items():
                if other != item:  # ``other`` co-occurred with ``item``, so it has a row of its own
                    scores[other] = scores.get(other, 0.0) + shared / math.sqrt(norm * self._cooc[other][other])
        return scores

    def scores(self, history: Sequence[str], candidates: Sequence[str]) -> list[float]:
        """The stage's score of each of ``candidates`` for ``history`` (:meth:`knn_scores`; 0 for an item
        the history never co-occurs with) — what it hands the reranker beside them as
        ``retrieval_scores`` (:func:`kvshard.ranking.fuse_scores`)."""
        knn = self.knn_scores(history)
        return [knn.get(item, 0.0) for item in candidates]

    def retrieve(self, history: Sequence[str], k: int, exclude: Collection[str] = ()) -> list[Retrieved]:
        """The ``k`` best items for ``history``, best first: the kNN neighbours (ties: the more popular,
        then natural id order), then the most popular items not yet listed. Never an item of ``history``
        or of ``exclude`` (the user's other past interactions). Raises ``ValueError`` when fewer than
        ``k`` items are left to retrieve."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        banned = set(history) | set(exclude)
        scored = [(item, score) for item, score in self.knn_scores(history).items() if item not in banned]
        scored.sort(key=lambda pair: (-pair[1], -self.count(pair[0]), _natural(pair[0])))
        out = [Retrieved(item, score, "knn") for item, score in scored[:k]]
        if len(out) < k:
            listed = banned | {r.item for r in out}
            for item in self.popular:
                if item not in listed:
                    out.append(Retrieved(item, 0.0, "popular"))
                    if len(out) == k:
                        break
        if len(out) < k:
            raise ValueError(f"only {len(out)} items are left to retrieve, {k} asked for")
        return out

    def hard_negatives(self, history: Sequence[str], exclude: Collection[str], count: int) -> list[str]:
        """The stage's ``count`` best items for ``history``, none of ``exclude``: the negatives a reranker
        trained for this stage should learn to tell from the target (:func:`kvshard.splits.training_requests`
        passes the user's whole history as ``exclude``, so the target is never among them)."""
        return [r.item for r in self.retrieve(history, count, exclude)] if count > 0 else []

    def describe(self) -> dict[str, object]:
        """The stage as provenance records it."""
        return {"stage": "item-kNN (cosine co-occurrence, summed over the history) topped up with popular items",
                "users_in_counts": len(self.users), "items": len(self.popular),
                "excluded": "the history and every earlier interaction of the user"}


@dataclass(frozen=True)
class RetrievedRequest:
    """A request whose candidates are the retrieval stage's, with the stage's own order beside it."""

    request: RecommendationRequest
    """What the reranker sees: the history and the retrieved items in a seeded shuffle; ``target`` is the
    held-out item, among the candidates only when the stage retrieved it."""
    order: tuple[str, ...]
    """The retrieved items in the stage's order, best first."""
    scores: tuple[float, ...] = field(default=())
    """The stage's score of each item of ``order``."""

    @property
    def retrieval_rank(self) -> int | None:
        """0-based position of the target in the stage's order (None: not retrieved)."""
        target = self.request.target
        return self.order.index(target) if target is not None and target in self.order else None

    @property
    def retrieved(self) -> bool:
        return self.retrieval_rank is not None


def retrieved_request(index: RetrievalIndex, rng: random.Random, user: str, past: Sequence[str], target: str,
                      history: int, candidates: int) -> RetrievedRequest:
    """One request at a target whose earlier interactions are ``past``: the last ``history`` of them are
    the query and the prompt's history, all of them are excluded, and the ``candidates`` retrieved items
    are shuffled with ``rng``. The target is only compared with the result, never used to build it."""
    shown = tuple(past[-history:])
    found = index.retrieve(shown, candidates, exclude=past)
    pool = [r.item for r in found]
    rng.shuffle(pool)
    return RetrievedRequest(RecommendationRequest(user, shown, tuple(pool), target),
                            tuple(r.item for r in found), tuple(r.score for r in found))


def retrieval_requests(dataset: Dataset, index: RetrievalIndex, users: int, history: int, candidates: int,
                       seed: int = 0, positions: int = 1) -> list[RetrievedRequest]:
    """Leave-last-out requests like :func:`kvshard.prompts.sample_requests` — the same users for the same
    seed, each user's last item as the target (and, with ``positions`` > 1, the items before it, latest
    first) and the ``history`` items before it as the history — with the retrieval stage's ``candidates``
    items instead of the target plus uniform negatives.

    Raises ``ValueError`` when a sampled user's interactions are in the index's counts (their target
    could have shaped their own candidates) or for a bad size."""
    if candidates < 2:
        raise ValueError("candidates must be at least 2")
    if history < 1:
        raise ValueError("history must be at least 1")
    if positions < 1:
        raise ValueError("positions must be at least 1")
    rng = random.Random(seed)
    eligible = [u for u, h in dataset.histories.items() if len(h) > history]
    rng.shuffle(eligible)
    out = []
    for user in eligible[:users]:
        if user in index.users:
            raise ValueError(f"user {user!r} is in the retrieval statistics: sample users the index was not fitted on")
        items = dataset.histories[user]
        for end in target_positions(len(items), history, positions):
            draw = rng if end == len(items) - 1 else position_rng(seed, user, end)
            out.append(retrieved_request(index, draw, user, items[:end], items[end], history, candidates))
    return out


def quality_or_miss(rank: int | None) -> dict[str, float]:
    """HR@1/HR@5/NDCG@10 of a ranking that put the target at ``rank`` (0-based); a target that is not
    among the candidates (``None``: the stage missed it) scores 0 on every metric."""
    if rank is None:
        return dict.fromkeys(QUALITY_METRICS, 0.0)
    return {"hr1": hit_at(rank, 1), "hr5": hit_at(rank, 5), "ndcg10": ndcg_at(rank, 10)}


def recall(requests: Sequence[RetrievedRequest]) -> float:
    """Share of requests whose target the stage retrieved (recall@K with one relevant item)."""
    return sum(r.retrieved for r in requests) / len(requests) if requests else 0.0


def _natural(text: str) -> tuple[int, str]:
    return (int(text), "") if text.isdigit() else (1 << 62, text)
