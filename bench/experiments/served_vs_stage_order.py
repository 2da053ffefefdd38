"""Isolating experiment (issue 42): does the served ranking beat the retrieval stage's own order on the
stage's candidates, replicated on requests no earlier run scored?

The target: behind a retrieval stage, the served ranking ``z(model) + W · z(stage)`` (``W`` the weight the
merge records) must rank the stage's candidates better than the stage's own order. On the 251 held-out
requests whose target the stage retrieved among each user's last 5 items (``served_cost_of_caching.py``)
the shipped late scorer served NDCG@10 .347 against the stage's .337 — a gain inside its noise. This script
asks the same on fresh requests: the retrieved targets among each held-out user's items 6–10 from the end
(those not already among the last 5), then both sets pooled, users resampled (2,000 resamples).

Run: ``cd bench/experiments && ../../.venv/bin/python served_vs_stage_order.py [MODEL ...]`` (default
``late scorer``; ~5 min per model for the fresh set's scores, cached in /tmp/late_scorer_ensembles/).

Answer (2026-12-06; the shipped late adapter at its 2.25, the isolated scorer at its 3):

    set (retrieved targets)             served − stage's order NDCG@10     HR@1
    late      items 1–5 (251)           +.011 (−.008 … +.029)             −.012 (−.040 … +.012)
              items 6–10 (284, fresh)   −.008 (−.026 … +.007)             −.021 (−.048 … +.004)
              pooled (535)              +.001 (−.012 … +.015)             −.017 (−.038 … +.002)
    isolated  items 1–5 (251)           +.009 (−.007 … +.024)             −.008 (−.029 … +.012)
              items 6–10 (284, fresh)   +.009 (−.004 … +.021)             +.011 (−.014 … +.035)
              pooled (535)              +.009 (−.002 … +.019)             +.002 (−.014 … +.018)

The first set's gain does not replicate: pooled, the late scorer served is level with the stage's own order
on NDCG@10 (to ±.015) and, if anything, below it on HR@1 — the model's reading of an item adds nothing
measurable to what the item-kNN stage's score already holds about which of its own candidates comes next.
The isolated scorer's +.009 held on both sets (pooled −.002 … +.019): a hint, not beyond noise, that
reading the history causally is worth something among the stage's close neighbours where the late scorer's
four interaction tokens are not.
"""

from __future__ import annotations

import statistics
import sys

from fusion_weight import STAGE, per_request
from late_scorer_ensembles import model_scores

from kvshard.datasets import load_dataset
from kvshard.models import model_retrieval_weight, resolve_model
from kvshard.prompts import RecommendationRequest, request_users, sample_requests
from kvshard.retrieval import RetrievalIndex, retrieval_requests
from kvshard.splits import UserSplit
from kvshard_bench.paired import paired_difference


def retrieved_sets() -> tuple[RetrievalIndex, dict[str, list[RecommendationRequest]]]:
    """The retrieved held-out requests among each user's last 5 items and, fresh, among items 6–10."""
    dataset = load_dataset("movielens-100k")
    split = UserSplit()
    index = RetrievalIndex.fit(dataset, split)
    heldout = split.heldout_dataset(dataset)
    first = {(r.user_id, r.target) for r in sample_requests(heldout, 191, 10, 20, 0, 5)}
    return index, {
        "retrieved-p5": [r.request for r in retrieval_requests(heldout, index, 191, 10, 20, 0, 5) if r.retrieved],
        "retrieved-p10-after5": [r.request for r in retrieval_requests(heldout, index, 191, 10, 20, 0, 10)
                                 if r.retrieved and (r.request.user_id, r.request.target) not in first]}


Answers = list[dict[str, float]]


def report(name: str, served: Answers, own: Answers, users: list[str]) -> None:
    """One set's served − the stage's order, paired per request, users resampled."""
    for metric in ("ndcg10", "hr1"):
        mean, low, high = paired_difference([a[metric] for a in served], [a[metric] for a in own], 0, users)
        print(f"  {name:<21} ({len(served)} requests) {metric:<6} served "
              f"{statistics.fmean(a[metric] for a in served):.3f}, stage's order "
              f"{statistics.fmean(a[metric] for a in own):.3f}: {mean:+.3f} (95 % CI {low:+.3f} … {high:+.3f})")


def main(models: tuple[str, ...] = ("late", "scorer")) -> None:
    index, sets = retrieved_sets()
    stages = {name: [index.scores(r.history, r.candidates) for r in requests] for name, requests in sets.items()}
    for spec in models:
        weight = model_retrieval_weight(resolve_model(spec))
        print(f"== {spec}, served at its recorded weight {weight:g}")
        pooled_served: Answers = []
        pooled_own: Answers = []
        pooled_users: list[str] = []
        for name, requests in sets.items():
            scores = model_scores(spec, "movielens-100k", name, requests)
            served = per_request(scores, stages[name], requests, weight)
            own = per_request(scores, stages[name], requests, STAGE)
            report(name, served, own, request_users(requests))
            pooled_served += served
            pooled_own += own
            pooled_users += request_users(requests)
        report("pooled", pooled_served, pooled_own, pooled_users)


if __name__ == "__main__":
    main(tuple(sys.argv[1:]) or ("late", "scorer"))
