"""Paired comparison of two merged scorers on the same requests (issue 42's attempt table).

The bench's per-model intervals (`kvshard bench recommender`) are wide (±.07 at 191 users); two scorers
ranked on the *same* requests differ by much less than that noise, so a training attempt is judged by the
paired difference per request, with a 95 % bootstrap interval. This script scores the bench's held-out
sample (history 10, 20 uniform candidates, seed 0, one order: both scorers are order-free) and the
fine-tuning validation prompts (96 training users' second-to-last items, seed 1) with both models, and
on the held-out requests whose target the retrieval stage retrieved (``--candidate-set retrieval``'s
"retrieved" columns; every other request scores 0 for every ranking), and prints each alone, each fused
1 : 1 with item-kNN (what the sidecar serves a request that carries the retrieval stage's scores), and
the paired differences candidate − baseline in HR@1 and NDCG@10.

Run: ``.venv/bin/python bench/experiments/paired_scorers.py BASELINE CANDIDATE [VALIDATION]`` — model names or
merged folders, and optionally how many validation prompts (default 96); ~1 s per prompt and model on 2 idle
cores, scores cached in /tmp/late_scorer_ensembles/.
"""

from __future__ import annotations

import statistics
import sys

from late_scorer_ensembles import fused, model_scores, paired_line

from kvshard.datasets import load_dataset
from kvshard.prompts import sample_requests
from kvshard.ranking import quality
from kvshard.retrieval import RetrievalIndex, retrieval_requests
from kvshard.splits import UserSplit, validation_requests
from kvshard_training.teacher import ItemKnnTeacher


def main(baseline: str, candidate: str, validation_prompts: int = 96) -> None:
    dataset = load_dataset("movielens-100k")
    split = UserSplit()
    training_users = split.training_users(dataset)
    knn = ItemKnnTeacher(dataset.histories, training_users)
    stage = retrieval_requests(split.heldout_dataset(dataset), RetrievalIndex.fit(dataset, split), 191, 10, 20)
    sets = {"held-out": sample_requests(split.heldout_dataset(dataset), 191, 10, 20, 0),
            "validation" + ("" if validation_prompts == 96 else str(validation_prompts)):
                validation_requests(dataset, training_users, 10, 20, validation_prompts, 1),
            "retrieved": [r.request for r in stage if r.retrieved]}
    for name, requests in sets.items():
        scores = {"knn": [knn.scores(r.history, r.candidates, r.user_id if name.startswith("validation") else None)
                          for r in requests],
                  "baseline": model_scores(baseline, dataset.name, name, requests),
                  "candidate": model_scores(candidate, dataset.name, name, requests)}
        targets = [r.candidates.index(str(r.target)) for r in requests]
        print(f"== {name} ({len(requests)} requests): baseline {baseline}, candidate {candidate}")
        for fuse in (False, True):
            hits, ndcg = {}, {}
            for model in ("baseline", "candidate"):
                weights = {model: 1.0, "knn": 1.0} if fuse else {model: 1.0}
                answers = [quality(fused(scores, weights, i), t) for i, t in enumerate(targets)]
                hits[model] = [a["hr1"] for a in answers]
                label = f"{model} + item-kNN" if fuse else model
                print(f"  {label:<22} HR@1 {statistics.fmean(hits[model]):.3f}  "
                      f"NDCG@10 {statistics.fmean(a['ndcg10'] for a in answers):.3f}")
                ndcg[model] = [a["ndcg10"] for a in answers]
            for metric, values in (("HR@1", hits), ("NDCG@10", ndcg)):
                differences = [a - b for a, b in zip(values["candidate"], values["baseline"], strict=True)]
                print(paired_line("candidate", "baseline" + (" (fused)" if fuse else ""), differences, metric))


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2], *(int(n) for n in sys.argv[3:]))
