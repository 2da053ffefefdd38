"""Isolating experiment (issue 42): what does cacheability cost where the ranking is served, behind a
retrieval stage, each model at its own fusion weight?

Alone, the isolated scorer ranks above the late one on held-out users (HR@1 .338 against .307 on 955
requests, paired +.031, +.002 … +.062): the late scorer's item tokens read only their item, so their KV is
reusable across users, and that costs ranking quality at one CPU hour of training. But a reranker is served
behind a retrieval stage, ranking by ``z(model) + W · z(stage)`` with ``W`` chosen per model on validation
prompts (``kvshard model fusion-weight``; late 2, isolated 3, recorded in the shipped adapters'
provenance). This script reads both models' cached scores on the held-out sets of
``fusion_weight.py`` (run it first for ``late`` and ``scorer``: it caches them in
/tmp/late_scorer_ensembles/) and prints, per set, each ranking's HR@1 and NDCG@10 alone and fused at its
model's own weight, and the paired difference late − isolated (users resampled, 2,000 resamples).

Run: ``cd bench/experiments && ../../.venv/bin/python served_cost_of_caching.py [POSITIONS] [FIRST SECOND]``
(seconds: it only reads cached scores). ``FIRST`` and ``SECOND`` default to ``late`` and ``scorer``; any two
merged models compare the same way (``FIRST − SECOND``), each at the weight its merge records
(:func:`kvshard.models.model_retrieval_weight`) — e.g. a new late scorer against the shipped one.

``late`` in this answer: the adapter shipped until 2026-12-06 (see ``late_scorer_ensembles.py``).

Answer (2026-12-06, the shipped adapters; late fused at 2, isolated at 3):

    set                              ranking              HR@1   NDCG@10
    held-out, uniform (955)          late alone           .307   .586
                                     late + 2 × stage     .430   .684
                                     isolated alone       .338   .606
                                     isolated + 3 × stage .461   .698
                                     stage alone          .443   .684
    retrieval-stage candidates       late + 2 × stage     .112   .349   (retrieved requests; all = × .263)
    (251 retrieved of 955)           isolated + 3 × stage .100   .345
                                     stage alone          .108   .337

    paired late − isolated           alone                           served (each at its own weight)
    uniform      HR@1                −.031 (−.062 … −.002)           −.030 (−.047 … −.014)
                 NDCG@10             −.020 (−.037 … −.003)           −.014 (−.022 … −.007)
    retrieval    HR@1                −.028 (−.072 … +.016)           +.012 (−.016 … +.037)
                 NDCG@10             −.018 (−.054 … +.017)           +.004 (−.012 … +.021)

On uniform negatives the cost of cacheability survives the fusion, and is measured more sharply there (the
stage's score takes out much of both rankings' noise): −.030 HR@1. On the retrieval stage's own candidates,
what a reranker behind a stage is handed, the two are level as served. Against the stage's score alone, on
uniform negatives the isolated scorer served at 3 is above it (NDCG@10 +.014, +.005 … +.023;
``fusion_weight.py scorer``) and the late scorer at 2 level with it (−.000, −.010 … +.010).
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

MODELS = ("late", "scorer")


def main(positions: int = 5, models: tuple[str, str] = MODELS) -> None:
    dataset = load_dataset("movielens-100k")
    split = UserSplit()
    index = RetrievalIndex.fit(dataset, split)
    heldout = split.heldout_dataset(dataset)
    staged = retrieval_requests(heldout, index, 191, 10, 20, 0, positions)
    sets: dict[str, list[RecommendationRequest]] = {
        f"held-out-p{positions}": sample_requests(heldout, 191, 10, 20, 0, positions),
        f"retrieved-p{positions}": [r.request for r in staged if r.retrieved]}
    weights = {spec: model_retrieval_weight(resolve_model(spec)) for spec in models}
    print(f"fusion weights recorded in the merges: {weights}")
    for name, requests in sets.items():
        stage = [index.scores(r.history, r.candidates) for r in requests]
        users = request_users(requests)
        answers = {}
        for spec, weight in weights.items():
            scores = model_scores(spec, dataset.name, name, requests)
            answers[f"{spec} alone"] = per_request(scores, stage, requests, 0.0)
            answers[f"{spec} + {weight:g} × stage"] = per_request(scores, stage, requests, weight)
        answers["stage alone"] = per_request([[0.0] * len(r.candidates) for r in requests], stage, requests, STAGE)
        print(f"== {name} ({len(requests)} requests, {len(set(users))} users)")
        for ranking, quality in answers.items():
            print(f"  {ranking:<22} HR@1 {statistics.fmean(q['hr1'] for q in quality):.3f}  "
                  f"NDCG@10 {statistics.fmean(q['ndcg10'] for q in quality):.3f}")
        first, second = models
        for kind, first_key, second_key in (("alone", f"{first} alone", f"{second} alone"),
                                            ("served", f"{first} + {weights[first]:g} × stage",
                                             f"{second} + {weights[second]:g} × stage")):
            for metric in ("hr1", "ndcg10"):
                mean, low, high = paired_difference([q[metric] for q in answers[first_key]],
                                                    [q[metric] for q in answers[second_key]], 0, users)
                print(f"  paired {first} − {second}, {kind:<6} {metric:<6} {mean:+.3f} "
                      f"(95 % CI {low:+.3f} … {high:+.3f})")


if __name__ == "__main__":
    if len(sys.argv) not in (1, 2, 4):
        sys.exit("usage: served_cost_of_caching.py [POSITIONS] [FIRST SECOND]")
    main(*(int(n) for n in sys.argv[1:2]), *([(sys.argv[2], sys.argv[3])] if len(sys.argv) == 4 else []))
