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
candidates, summed with a weight. The stage's co-occurrence statistics and the model's reading of the
items make different mistakes (``bench/experiments/late_scorer_ensembles.py``), and the fusion costs no
model compute and leaves the cached KV untouched. How much the stage should weigh depends on the model:
:func:`choose_fusion_weight` picks it on validation prompts, fine-tuning records it, and the sidecar uses
it unless a request says otherwise (1 for a model that records none).
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


FUSION_WEIGHTS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
"""The stage weights whose validation quality :class:`FusionChoice` reports, fixed before any measurement (0: the
model alone); the largest bounds the chosen weight."""

FUSION_RIDGE = 1e-3
"""The L2 penalty on the fit's two coefficients: it keeps them finite when validation separates perfectly (a
stage or model that ranks every target first), and is small beside any real prompt set's log-likelihood."""


@dataclass(frozen=True)
class FusionChoice:
    """The stage weight fitted on validation prompts, and what it and every weight of the grid scored."""

    weight: float
    by_weight: dict[float, dict[str, float]]
    """Each weight of :data:`FUSION_WEIGHTS`, and the chosen one → mean HR@1, HR@5 and NDCG@10 of the fused
    ranking."""
    stage_alone: dict[str, float]
    """The same for the stage's own order (what the fusion has to beat)."""
    prompts: int

    def as_json(self) -> dict[str, object]:
        def rounded(metrics: dict[str, float]) -> dict[str, float]:
            return {name: round(value, 4) for name, value in metrics.items()}

        return {"retrieval_weight": self.weight, "chosen_by": "max log-likelihood of each validation prompt's "
                "held-out candidate under softmax(a·z(model) + b·z(stage)), W = b/a (to .05, within 0 … "
                f"{FUSION_WEIGHTS[-1]:g})", "prompts": self.prompts,
                "by_weight": {f"{w:g}": rounded(m) for w, m in self.by_weight.items()},
                "stage_alone": rounded(self.stage_alone)}


def choose_fusion_weight(model: Sequence[Sequence[float]], stage: Sequence[Sequence[float]],
                         targets: Sequence[int]) -> FusionChoice:
    """The weight ``W`` of :func:`fuse_scores` fitted on prompts whose held-out candidate is ``targets[i]``
    (:func:`likelihood_fusion_weight`), with the validation quality of it and of every :data:`FUSION_WEIGHTS`.

    Why a likelihood fit and not the grid weight with the best NDCG@10 (the rule before 2026-12-06): a
    metric read at the top of the list moves in steps of one prompt, so over a few hundred prompts its
    optimum is flat and the argmax lands anywhere on the plateau; the log-likelihood reads where every
    target sits under a smooth score and has one optimum. Measured on four late and isolated scorers, each
    weight chosen on training users' validation prompts and judged on 955 held-out requests
    (``bench/experiments/fusion_weight_rule.py``): the fit was level with the argmax where that had 300
    prompts, above it where it had 96 (NDCG@10 +.021 and +.009, both beyond noise), and below it nowhere
    beyond noise."""
    if not (len(model) == len(stage) == len(targets)) or not targets:
        raise ValueError("need one model score list, one stage score list and one target per prompt")

    def mean(rankings: Sequence[Sequence[float]]) -> dict[str, float]:
        totals = dict.fromkeys(QUALITY_METRICS, 0.0)
        for scores, target in zip(rankings, targets, strict=True):
            for name, value in quality(scores, target).items():
                totals[name] += value
        return {name: value / len(targets) for name, value in totals.items()}

    chosen = likelihood_fusion_weight(model, stage, targets)
    by_weight = {float(w): mean([fuse_scores(m, s, w) for m, s in zip(model, stage, strict=True)])
                 for w in sorted({*FUSION_WEIGHTS, chosen})}
    return FusionChoice(chosen, by_weight, mean(stage), len(targets))


def likelihood_fusion_weight(model: Sequence[Sequence[float]], stage: Sequence[Sequence[float]],
                             targets: Sequence[int]) -> float:
    """``W = b / a`` for the ``(a, b)`` that maximize the mean log-probability of each prompt's target under
    ``softmax(a · z(model) + b · z(stage))`` over its candidates (a conditional logit, concave in ``(a, b)``:
    Newton's method with a backtracking line search, :data:`FUSION_RIDGE` keeping it bounded). A stage that
    does not help (``b ≤ 0``) gets 0; a model that does not (``a ≤ 0``) leaves the stage the largest grid
    weight. Rounded to .05, within 0 … ``FUSION_WEIGHTS[-1]``. Candidates with a non-finite score are left
    out of their prompt, and a prompt whose target is among them is left out."""
    prompts: list[tuple[list[tuple[float, float]], int]] = []
    for scores, staged, target in zip(model, stage, targets, strict=True):
        pairs = list(zip(standardized(scores), standardized(staged), strict=True))
        kept = [j for j, (m, s) in enumerate(pairs) if math.isfinite(m) and math.isfinite(s)]
        if target in kept and len(kept) > 1:
            prompts.append(([pairs[j] for j in kept], kept.index(target)))
    if not prompts:
        raise ValueError("no prompt whose target and another candidate have finite scores")

    def fit(a: float, b: float) -> tuple[float, tuple[float, float], tuple[float, float, float]]:
        """Objective, gradient and the Hessian's (aa, ab, bb) at (a, b)."""
        total = ga = gb = haa = hab = hbb = 0.0
        for pairs, target in prompts:
            logits = [a * m + b * s for m, s in pairs]
            top = max(logits)
            weights = [math.exp(v - top) for v in logits]
            norm = math.fsum(weights)
            p = [w / norm for w in weights]
            em = math.fsum(q * m for q, (m, _) in zip(p, pairs, strict=True))
            es = math.fsum(q * s for q, (_, s) in zip(p, pairs, strict=True))
            total += logits[target] - top - math.log(norm)
            ga += pairs[target][0] - em
            gb += pairs[target][1] - es
            haa += math.fsum(q * (m - em) ** 2 for q, (m, _) in zip(p, pairs, strict=True))
            hab += math.fsum(q * (m - em) * (s - es) for q, (m, s) in zip(p, pairs, strict=True))
            hbb += math.fsum(q * (s - es) ** 2 for q, (_, s) in zip(p, pairs, strict=True))
        n = len(prompts)
        value = total / n - FUSION_RIDGE / 2 * (a * a + b * b)
        return (value, (ga / n - FUSION_RIDGE * a, gb / n - FUSION_RIDGE * b),
                (haa / n + FUSION_RIDGE, hab / n, hbb / n + FUSION_RIDGE))

    a, b = 1.0, 1.0
    value, (ga, gb), (haa, hab, hbb) = fit(a, b)
    for _ in range(100):
        det = haa * hbb - hab * hab  # the negated Hessian is positive definite (ridge), so det > 0
        da, db = (hbb * ga - hab * gb) / det, (haa * gb - hab * ga) / det
        slope, step = ga * da + gb * db, 1.0
        while True:
            trial = fit(a + step * da, b + step * db)
            if trial[0] >= value + 1e-4 * step * slope or step < 1e-10:
                break
            step /= 2
        a, b = a + step * da, b + step * db
        value, (ga, gb), (haa, hab, hbb) = trial
        if max(abs(step * da), abs(step * db)) < 1e-9:
            break
    if b <= 0:
        return 0.0
    if a <= 0:
        return FUSION_WEIGHTS[-1]
    return min(FUSION_WEIGHTS[-1], round(b / a * 20) / 20)
