"""Isolating experiment (issue 42): what did a model's scores become, beside another's on the same requests?

For merged late scorers already scored by ``fusion_weight.py`` (their scores cached in
/tmp/late_scorer_ensembles/), on its 96 validation prompts and 955 held-out requests, this prints per model:
HR@1; the validation loss finetune reports (cross-entropy of the raw scores against the target); how
confident the scores are (their standard deviation within a prompt); and what they follow — the mean
correlation, within a prompt, of the model's scores with the retrieval stage's (item-kNN co-occurrence) and
with each candidate's popularity (log interaction count over training users); then each model's paired HR@1
difference from the first (users resampled); and HR@1 by where the target stands in the candidates'
popularity order. Popularity is the bench's baseline (``kvshard_bench.recommender.popularity_scores``:
rating counts less the requests' own targets).

Run: ``cd bench/experiments && ../../.venv/bin/python score_shape.py FIRST SECOND [...]`` (seconds: it only
reads cached scores; run ``fusion_weight.py MODEL 96 5`` for each model first).

Answer (2026-12-07: the in-hour late adapter, then the same adapter trained a second hour on fresh examples,
``--init-adapter … --seed 1``; docs/experiments.md):

    set               model         HR@1   loss   score sd  r(stage)  r(popularity)
    validation (96)   first hour    .469   1.976  1.100     .696      .578
                      second hour   .354   1.960  1.163     .794      .717
                      stage / popularity alone  .479 / .333
    held-out (955)    first hour    .354   2.129  1.122     .678      .546
                      second hour   .370   2.048  1.180     .784      .698
                      stage / popularity alone  .443 / .271
    paired second − first HR@1: validation −.115 (−.208 … −.021), held-out +.016 (−.012 … +.046)
    first candidate the most popular: validation .40 → .42, held-out .37 → .45

    HR@1 by the target's popularity rank among the 20 candidates (first hour → second hour):
                      rank 1              ranks 2–3           ranks 4–20
    validation (96)   .688 → .594 (32)    .545 → .500 (22)    .262 → .095 (42)
    held-out (955)    .614 → .714 (259)   .364 → .411 (236)   .202 → .154 (460)

The second hour lowered the loss on both sets and moved the scores toward the stage and toward popularity
(the stage itself follows popularity at r .81–.83). That trade wins where the target is the most popular
candidate and loses where it is not; its net sign is the set's: +.016 HR@1 on the 955 held-out requests,
−.115 on 96 validation prompts, whose 42 less popular targets lost most.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from fusion_weight import POSITIONS
from late_scorer_ensembles import model_scores

from kvshard.datasets import load_dataset
from kvshard.prompts import RecommendationRequest, request_users, sample_requests
from kvshard.ranking import best_index
from kvshard.retrieval import RetrievalIndex
from kvshard.splits import UserSplit, validation_requests
from kvshard_bench.paired import paired_difference
from kvshard_bench.recommender import popularity_scores
from kvshard_training.teacher import ItemKnnTeacher

SEED = 0
POPULARITY_BANDS = ((0, 0), (1, 2), (3, 19))


def correlation(a: Sequence[float], b: Sequence[float]) -> float:
    """Pearson's r of two equal-length lists (0 where either is constant)."""
    try:
        return statistics.correlation(a, b)
    except statistics.StatisticsError:
        return 0.0


def main(specs: list[str]) -> None:
    dataset = load_dataset("movielens-100k")
    split = UserSplit()
    training_users = split.training_users(dataset)
    knn = ItemKnnTeacher(dataset.histories, training_users)
    index = RetrievalIndex.fit(dataset, split)
    heldout = split.heldout_dataset(dataset)
    sets: dict[str, list[RecommendationRequest]] = {
        "validation96": validation_requests(dataset, training_users, 10, 20, 96, 1),
        f"held-out-p{POSITIONS}": sample_requests(heldout, 191, 10, 20, SEED, POSITIONS)}
    for name, requests in sets.items():
        validation = name.startswith("validation")
        stage = [knn.stage_scores(r.history, r.candidates, r.user_id) if validation
                 else index.scores(r.history, r.candidates) for r in requests]
        counts = popularity_scores(dataset, [[r] for r in requests])
        popular = [[math.log1p(count) for count in counts(r)] for r in requests]
        targets = [r.candidates.index(str(r.target)) for r in requests]
        users = request_users(requests)
        print(f"== {name} ({len(requests)} requests)")
        print(f"  {'model':<48} HR@1   loss   score sd   r(stage)  r(popularity)")
        hits: dict[str, list[float]] = {}
        scored = {spec: model_scores(spec, dataset.name, name, requests) for spec in specs}
        for spec, scores in scored.items():
            hits[spec] = [float(best_index(s) == t) for s, t in zip(scores, targets, strict=True)]
            loss = float(F.cross_entropy(torch.tensor(scores), torch.tensor(targets)))  # finetune's validation loss
            spread = statistics.fmean(statistics.pstdev(s) for s in scores)
            follows_stage = statistics.fmean(correlation(s, g) for s, g in zip(scores, stage, strict=True))
            follows_popularity = statistics.fmean(correlation(s, p) for s, p in zip(scores, popular, strict=True))
            print(f"  {spec:<48} {statistics.fmean(hits[spec]):.3f}  {loss:.3f}  {spread:8.3f}  "
                  f"{follows_stage:8.3f}  {follows_popularity:13.3f}")
        for label, baseline in (("the stage alone", stage), ("popularity alone", popular)):
            hit = statistics.fmean(float(best_index(b) == t) for b, t in zip(baseline, targets, strict=True))
            follows = statistics.fmean(correlation(b, p) for b, p in zip(baseline, popular, strict=True))
            print(f"  {label:<48} {hit:.3f}{'':35}{follows:.3f}")
        for spec in specs[1:]:
            mean, low, high = paired_difference(hits[spec], hits[specs[0]], SEED, users)
            print(f"  paired {spec} − {specs[0]} HR@1 {mean:+.3f} (95 % CI {low:+.3f} … {high:+.3f})")
        standing = [sum(p > row[t] for p in row) for row, t in zip(popular, targets, strict=True)]
        most_popular = [best_index(row) for row in popular]
        print("  share of requests whose first candidate is the most popular: " + ", ".join(
            f"{statistics.fmean(float(best_index(s) == m) for s, m in zip(scores, most_popular, strict=True)):.2f}"
            for scores in scored.values()))
        for low_rank, high_rank in POPULARITY_BANDS:  # 0: no candidate is more popular than the target
            members = [i for i, rank in enumerate(standing) if low_rank <= rank <= high_rank]
            band = f"{low_rank + 1}" if low_rank == high_rank else f"{low_rank + 1}–{high_rank + 1}"
            print(f"  target's popularity rank {band} of {len(popular[0])} ({len(members)} requests): HR@1 "
                  + ", ".join(f"{statistics.fmean(hits[spec][i] for i in members):.3f}" for spec in specs))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1:])
