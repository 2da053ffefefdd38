"""Isolating experiment (issue 42): which rule chooses the retrieval stage's weight so that it carries over
from training users' validation prompts to held-out users?

The served ranking behind a retrieval stage is ``z(model) + W · z(stage)``, ``W`` chosen per model on
validation prompts. Until 2026-12-06 the rule took the grid weight (0, .5, 1, 1.5, 2, 3, 4, 6, 8) with the
best validation NDCG@10, ties to the smaller. The ``--accumulation 2`` adapter showed what that costs: its
validation NDCG@10 was within .002 across weights 1 … 2, the tie went to 1, and on held-out users the
larger weights won (``docs/experiments.md``). A metric read at the top of the list moves in steps of one
prompt, so on a flat optimum the argmax lands anywhere on the plateau. The likelihood of each target under
``softmax(a · z(model) + b · z(stage))`` reads where every target sits under a smooth, concave objective;
``W = b / a`` (:func:`kvshard.ranking.likelihood_fusion_weight`).

This script compares the two rules on every model whose scores ``fusion_weight.py`` cached (run it first:
``fusion_weight.py MODEL VALIDATION``): each rule chooses on the model's validation prompts, and both
choices are judged on the held-out sets, paired (users resampled, 2,000 resamples): fit − argmax.

Run: ``cd bench/experiments && ../../.venv/bin/python fusion_weight_rule.py [MODEL:VALIDATION ...]`` (seconds:
it reads cached scores; default the four models below).

``late`` in this answer: the adapter shipped until 2026-12-06 (see ``late_scorer_ensembles.py``).

Answer (2026-12-06; 955 held-out requests on uniform negatives, and the 251 whose target the stage
retrieved; fit − argmax, paired 95 % CI):

    model (validation prompts)   argmax W  fit W   held-out HR@1           held-out NDCG@10        retrieved NDCG@10
    shipped late (300)           2         2.65    +.007 (−.003 … +.017)   +.001 (−.003 … +.005)   −.005 (−.014 … +.006)
    shipped isolated (300)       3         2.35    +.000 (−.008 … +.008)   +.003 (−.001 … +.006)   +.002 (−.007 … +.010)
    --accumulation 2 (96)        .5        1.25    +.023 (+.005 … +.040)   +.021 (+.012 … +.029)   +.019 (−.000 … +.039)
    --layers 8 (96)              1.5       2.6     +.021 (+.006 … +.035)   +.009 (+.003 … +.015)   +.010 (−.003 … +.025)

The fit is level with the argmax where the argmax had 300 prompts, and above it, beyond noise, on both
models where it had 96 — the number fine-tuning validates on. It is below the argmax nowhere beyond noise.
So the rule is the fit, in ``kvshard.ranking.choose_fusion_weight``. (The ``--accumulation 2`` adapter's
recorded weight, 1, was the argmax on a different 300 prompts; on these 96 the argmax is .5.)
"""

from __future__ import annotations

import statistics
import sys

from fusion_weight import per_request
from late_scorer_ensembles import model_scores

from kvshard.datasets import load_dataset
from kvshard.prompts import RecommendationRequest, request_users, sample_requests
from kvshard.ranking import FUSION_WEIGHTS, choose_fusion_weight, fuse_scores, quality
from kvshard.retrieval import RetrievalIndex, retrieval_requests
from kvshard.splits import UserSplit, validation_requests
from kvshard_bench.paired import paired_difference
from kvshard_training.teacher import ItemKnnTeacher

MODELS = ("late:300", "scorer:300", "/tmp/ft/SmolLM2-135M-MovieLens-Late-Acc2:96",
          "/tmp/ft/SmolLM2-135M-MovieLens-Late-L8:96")


def argmax_weight(model: list[list[float]], stage: list[list[float]], targets: list[int]) -> float:
    """The rule before 2026-12-06: the grid weight with the best mean NDCG@10, ties to the smaller."""
    def ndcg(weight: float) -> float:
        return statistics.fmean(quality(fuse_scores(m, s, weight), t)["ndcg10"]
                                for m, s, t in zip(model, stage, targets, strict=True))
    return max(FUSION_WEIGHTS, key=lambda w: (ndcg(w), -w))


def main(models: tuple[str, ...] = MODELS) -> None:
    dataset = load_dataset("movielens-100k")
    split = UserSplit()
    training_users = split.training_users(dataset)
    knn = ItemKnnTeacher(dataset.histories, training_users)
    index = RetrievalIndex.fit(dataset, split)
    heldout = split.heldout_dataset(dataset)
    staged = retrieval_requests(heldout, index, 191, 10, 20, 0, 5)
    sets: dict[str, list[RecommendationRequest]] = {
        "held-out-p5": sample_requests(heldout, 191, 10, 20, 0, 5),
        "retrieved-p5": [r.request for r in staged if r.retrieved]}
    stages = {name: [index.scores(r.history, r.candidates) for r in requests] for name, requests in sets.items()}
    for entry in models:
        spec, prompts = entry.rsplit(":", 1)
        validation = validation_requests(dataset, training_users, 10, 20, int(prompts), 1)
        stage = [knn.stage_scores(r.history, r.candidates, r.user_id) for r in validation]
        scores = model_scores(spec, dataset.name, f"validation{prompts}", validation)
        targets = [r.candidates.index(str(r.target)) for r in validation]
        old, new = argmax_weight(scores, stage, targets), choose_fusion_weight(scores, stage, targets).weight
        print(f"== {spec} ({prompts} validation prompts): argmax W {old:g}, fit W {new:g}")
        for name, requests in sets.items():
            model = model_scores(spec, dataset.name, name, requests)
            fit, argmax = (per_request(model, stages[name], requests, w) for w in (new, old))
            users = request_users(requests)
            for metric in ("hr1", "ndcg10"):
                mean, low, high = paired_difference([q[metric] for q in fit], [q[metric] for q in argmax], 0, users)
                print(f"  {name:<13} {metric:<6} fit {statistics.fmean(q[metric] for q in fit):.3f}  argmax "
                      f"{statistics.fmean(q[metric] for q in argmax):.3f}  fit − argmax {mean:+.3f} "
                      f"(95 % CI {low:+.3f} … {high:+.3f})")


if __name__ == "__main__":
    main(tuple(sys.argv[1:]) or MODELS)
