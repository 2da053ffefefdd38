"""A collaborative-filtering teacher for ``kvshard model finetune``: soft targets over every candidate.

Why it exists. The plain fine-tuning target says which one of K candidates the user picked — one bit
of ranking per prompt, and on a 2-core CPU an hour buys a few thousand prompts. A 135M model trained
on that alone learned a letter prior, not the items (validation loss stayed above ln K). Item-kNN
over the *training* users' interactions ranks the same candidates well (HR@1 0.38 on held-out users'
last items, against 0.05 for random), so its scores give every candidate a graded target: the
student learns "the items this history co-occurs with" from all K labels of every prompt
(distillation; Hinton et al. 2015). The target stays the held-out item: the training distribution is
a mix, ``(1 - weight) · one-hot(target) + weight · softmax(teacher / temperature)``.

What the teacher may see follows :mod:`kvshard.splits`: only training users, and only their
interactions before the second-to-last (the validation target) — so neither validation nor the
benchmarks' last items, nor any held-out user, leak into it. Pure Python, torch-free.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from kvshard.ranking import quality


class ItemKnnTeacher:
    """Cosine item-item co-occurrence: ``sim(a, b) = |users(a) ∩ users(b)| / sqrt(|users(a)| |users(b)|)``;
    a candidate's score is its summed similarity to the history, plus a small popularity term that
    breaks ties between candidates the history never co-occurs with."""

    POPULARITY_WEIGHT = 1e-3

    def __init__(self, histories: Mapping[str, Sequence[str]], users: Iterable[str]) -> None:
        self._users_of: dict[str, set[str]] = defaultdict(set)
        for user in users:
            for item in histories[user][:-2]:  # never the validation target nor the last item
                self._users_of[item].add(user)

    def similarity(self, a: str, b: str, without: str | None = None) -> float:
        """Cosine co-occurrence of ``a`` and ``b``; ``without`` leaves one user out of the counts (a
        training example's own user, whose history would otherwise vouch for its own target)."""
        users_a, users_b = self._users_of.get(a, set()), self._users_of.get(b, set())
        small, large = (users_a, users_b) if len(users_a) <= len(users_b) else (users_b, users_a)
        shared = sum(1 for user in small if user in large and user != without)
        size_a = len(users_a) - (without in users_a)
        size_b = len(users_b) - (without in users_b)
        return shared / math.sqrt(size_a * size_b) if shared else 0.0

    def scores(self, history: Sequence[str], candidates: Sequence[str], without: str | None = None) -> list[float]:
        return [sum(self.similarity(h, c, without) for h in history)
                + self.POPULARITY_WEIGHT * math.log1p(len(self._users_of.get(c, set()) - {without}))
                for c in candidates]

    def stage_scores(self, history: Sequence[str], candidates: Sequence[str],
                     without: str | None = None) -> list[float]:
        """The retrieval stage's score (:meth:`kvshard.retrieval.RetrievalIndex.scores`: the summed similarity
        to the distinct history items, no popularity term) with ``without`` left out of the counts."""
        distinct = list(dict.fromkeys(history))
        return [sum(self.similarity(h, c, without) for h in distinct if h != c) for c in candidates]

    def distribution(self, history: Sequence[str], candidates: Sequence[str], temperature: float,
                     without: str | None = None) -> list[float]:
        """Softmax over the candidates of their standardised scores / ``temperature`` (scale-free, so
        one temperature means the same for short and long histories)."""
        return soft_distribution(self.scores(history, candidates, without), temperature)


def soft_distribution(scores: Sequence[float], temperature: float) -> list[float]:
    """Softmax of the z-scored ``scores`` divided by ``temperature`` (uniform when all are equal)."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    mean = sum(scores) / len(scores)
    spread = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
    if spread == 0:
        return [1.0 / len(scores)] * len(scores)
    logits = [(s - mean) / spread / temperature for s in scores]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def teacher_quality(teacher: ItemKnnTeacher,
                    requests: Iterable[tuple[str, Sequence[str], Sequence[str], int]]) -> dict[str, float]:
    """The teacher's own HR@1/HR@5/NDCG@10 over (user, history, candidates, target index), each
    user left out of the counts — what the student can at best be expected to approach."""
    totals: dict[str, float] = defaultdict(float)
    count = 0
    for user, history, candidates, target in requests:
        for name, value in quality(teacher.scores(history, candidates, user), target).items():
            totals[name] += value
        count += 1
    return {name: value / max(1, count) for name, value in totals.items()}
