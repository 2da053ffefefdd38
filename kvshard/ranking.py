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

A reranker sits behind a retrieval stage that has already scored the candidates it hands over.
:func:`fuse_scores` ranks by the model's and the stage's scores together: z-scores over the request's
candidates, summed with a fixed weight (1 : 1 by default, chosen before any measurement). The stage's
co-occurrence statistics and the model's reading of the items make different mistakes
(``bench/experiments/late_scorer_ensembles.py``), and the fusion costs no model compute and leaves the
cached KV untouched.
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
    fused: float | None = None
    """Its :func:`fuse_scores` score when the ranking fused the retrieval stage's scores (else None)."""

    def as_json(self) -> dict[str, str | float]:
        out: dict[str, str | float] = {"candidate": self.candidate, "label": self.label,
                                       "logprob": round(self.logprob, 6)}
        if self.fused is not None:
            out["fused_score"] = round(self.fused, 6)
        return out


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


def rank_candidates(candidates: Sequence[str], labels: Sequence[str], scores: Sequence[float],
                    fused: Sequence[float] | None = None) -> list[RankedCandidate]:
    """Every candidate, best first, with its label-restricted log-probability; ordered by ``fused``
    (:func:`fuse_scores`) when given, else by ``scores``."""
    if not len(candidates) == len(labels) == len(scores) == len(fused if fused is not None else scores):
        raise ValueError(f"{len(candidates)} candidates, {len(labels)} labels and {len(scores)} scores "
                         "must be as many")
    logprobs = label_logprobs(scores)
    by = scores if fused is None else fused
    order = sorted(range(len(candidates)), key=lambda i: (-by[i], i))  # scores decide, not their rounding
    return [RankedCandidate(candidates[i], labels[i], logprobs[i], None if fused is None else fused[i])
            for i in order]


def standardized(values: Sequence[float]) -> list[float]:
    """``values`` as z-scores over their finite members (population standard deviation); all 0 when the
    finite ones are equal; a non-finite value (a -inf log-probability) stays -inf."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        raise ValueError("no finite score to standardize")
    mean = math.fsum(finite) / len(finite)
    spread = math.sqrt(math.fsum((v - mean) ** 2 for v in finite) / len(finite))
    return [((v - mean) / spread if spread > 0 else 0.0) if math.isfinite(v) else -math.inf for v in values]


def fuse_scores(model: Sequence[float], retrieval: Sequence[float], weight: float = 1.0) -> list[float]:
    """``z(model) + weight · z(retrieval)`` per candidate: the reranker's scores fused with the retrieval
    stage's (each standardized over the request's candidates, so their scales do not matter)."""
    if len(model) != len(retrieval):
        raise ValueError(f"{len(model)} model scores and {len(retrieval)} retrieval scores must be as many")
    if not all(math.isfinite(r) for r in retrieval) or not math.isfinite(weight) or weight < 0:
        raise ValueError("retrieval scores must be finite and the weight finite and at least 0")
    return [m + weight * r for m, r in zip(standardized(model), standardized(retrieval), strict=True)]


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
