"""A recommendation is a ranking over the candidates; this module makes and scores rankings.

Why it exists. A generative recommender's answer is not the free first token: the model may put its
mass on "The" before any label, and a near tie between "A" and "The" says nothing about which
*candidate* it prefers. Generative recommenders constrain the answer to the candidates and rank
them by their label tokens' log-probabilities at the answer position; so does kvshard, the same way
for the embedded engine (label logits read directly) and for vLLM (the labels' log-probabilities
asked for by token id). Both hand this module one number per candidate.

Everything here is pure Python over floats — no torch — so the sidecar, the router-facing
benchmarks, the demo report and the tests share one definition of the ranking, of agreement with
full prefill, and of recommendation quality (HR@k, NDCG@k and their random expectation).

Ties are broken by candidate order (the prompt's order), so a ranking is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RankedCandidate:
    """One candidate in a ranking: the item id, its label in the prompt and its log-probability
    under the softmax over the candidates' label tokens (so the candidates' probabilities sum to 1)."""

    candidate: str
    label: str
    logprob: float

    def as_json(self) -> dict[str, str | float]:
        return {"candidate": self.candidate, "label": self.label, "logprob": round(self.logprob, 6)}


def label_logprobs(scores: Sequence[float]) -> list[float]:
    """Log-softmax over the candidates' label scores (logits, or full-vocabulary log-probabilities:
    both differ from the label-restricted log-probabilities by one constant)."""
    if not scores:
        raise ValueError("no candidates to rank")
    finite = [s for s in scores if math.isfinite(s)]
    if not finite:
        raise ValueError("every candidate's label score is -inf or NaN")
    top = max(finite)
    total = math.fsum(math.exp(s - top) for s in finite)
    norm = top + math.log(total)
    return [s - norm if math.isfinite(s) else -math.inf for s in scores]


def rank_candidates(candidates: Sequence[str], labels: Sequence[str], scores: Sequence[float]
                    ) -> list[RankedCandidate]:
    """Every candidate, best first, with its label-restricted log-probability."""
    if not len(candidates) == len(labels) == len(scores):
        raise ValueError(f"{len(candidates)} candidates, {len(labels)} labels and {len(scores)} scores "
                         "must be as many")
    logprobs = label_logprobs(scores)
    order = sorted(range(len(candidates)), key=lambda i: (-scores[i], i))  # scores decide, not their rounding
    return [RankedCandidate(candidates[i], labels[i], logprobs[i]) for i in order]


def best_index(scores: Sequence[float]) -> int:
    """Index of the chosen candidate (the highest score; the first one on a tie)."""
    if not scores:
        raise ValueError("no candidates")
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def rank_of(scores: Sequence[float], index: int) -> int:
    """0-based rank of candidate ``index`` in the ranking by ``scores`` (ties: earlier candidates first)."""
    mine = scores[index]
    return sum(1 for i, s in enumerate(scores) if s > mine or (s == mine and i < index))


def hit_at(rank: int, k: int) -> float:
    """HR@k of one answer: 1 when the held-out item is ranked in the top ``k``."""
    return 1.0 if rank < k else 0.0


def ndcg_at(rank: int, k: int) -> float:
    """NDCG@k of one answer with one relevant item: 1/log2(rank + 2) inside the top ``k``, else 0."""
    return 1.0 / math.log2(rank + 2) if rank < k else 0.0


QUALITY_METRICS = ("hr1", "hr5", "ndcg10")


def quality(scores: Sequence[float], target: int) -> dict[str, float]:
    """HR@1, HR@5 and NDCG@10 of ranking by ``scores`` against the held-out candidate ``target``."""
    rank = rank_of(scores, target)
    return {"hr1": hit_at(rank, 1), "hr5": hit_at(rank, 5), "ndcg10": ndcg_at(rank, 10)}


def random_quality(num_candidates: int) -> dict[str, float]:
    """What a uniformly random ranking of ``num_candidates`` scores in expectation (the target is at
    each rank with probability 1/K)."""
    if num_candidates < 1:
        raise ValueError("need at least one candidate")
    k = num_candidates
    return {"hr1": 1 / k, "hr5": min(5, k) / k,
            "ndcg10": sum(ndcg_at(rank, 10) for rank in range(k)) / k}


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall tau-b between two score lists (ties in either handled); 1.0 when both are constant."""
    if len(a) != len(b):
        raise ValueError("both rankings must score the same candidates")
    concordant = discordant = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = math.sqrt((concordant + discordant + ties_a) * (concordant + discordant + ties_b))
    return (concordant - discordant) / denominator if denominator else 1.0
