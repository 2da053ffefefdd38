"""Isolating experiment (issue 42): is the late scorer really worse than the isolated one, and which
teacher would be stronger than item-kNN alone?

`kvshard bench recommender --history 10 --users 191` measured held-out HR@1 .361 for the isolated scorer
and .309 for the late scorer (the cacheable one), while the two adapters' own validations (training users'
second-to-last items) said the opposite: .344 isolated, .422 late. This script scores the same requests
with both merged scorers and with item-kNN, and reports

* the **paired** difference late − isolated per request, with a 95 % bootstrap interval (the bench's
  intervals are per model; the same users make a paired interval much narrower);
* each ranking alone and the z-score sums of two or three of them (per request over its K candidates,
  weights 1 : 1 fixed in advance, nothing tuned on these users) — the teachers ``kvshard model finetune
  --teacher-model`` can mix (:mod:`kvshard_training.model_teacher`), and a fusion a server could apply.

Held-out: the bench's own sample (`sample_requests` over held-out users, history 10, 20 candidates, seed 0,
one order: both scorers are order-free). Validation: the fine-tuning run's validation prompts (96 training
users' second-to-last items, seed 1), item-kNN leaving each user out as in training.

Run: ``.venv/bin/python bench/experiments/late_scorer_ensembles.py [THREADS]`` (needs `kvshard model
prepare`; ~10 min on 2 idle cores, scores cached in /tmp/late_scorer_ensembles/).

``late`` in this answer is the late adapter shipped until 2026-12-06 (``git show
52fb9f0:training/kvshard_training/adapters/movielens-late/<file>``; merge it with ``kvshard model merge``
and pass the folder); ``late`` now names its successor, so a rerun by that name scores the shipped one.

Answer (2026-12-05, load average ~6 on 2 cores):

    held-out (191)                HR@1  NDCG@10     validation (96)   HR@1  NDCG@10
    item-kNN                      .387  .638                          .479  .690
    late                          .309  .581                          .406  .656
    isolated                      .361  .610                          .354  .624
    isolated + item-kNN           .382  .656                          .448  .706
    late + item-kNN               .372  .650                          .490  .716
    isolated + late               .361  .621                          .458  .685
    isolated + late + item-kNN    .424  .670                          .490  .719
    paired late − isolated        −.052 (−.120 … +.021)               +.052 (−.042 … +.146)

The late scorer is not measurably worse than the isolated one: the paired interval holds 0 on both sets,
and the sign flips between them (held-out: 18 requests only late ranks first, 28 only isolated). The
isolated scorer mixed into item-kNN makes a better *ranking* teacher (NDCG@10 up on both sets) but not a
better HR@1 one; the late scorer plus item-kNN beats item-kNN on both sets' NDCG@10 and the isolated
scorer's held-out HR@1 (.372 vs .361) — item-kNN's co-occurrence and the model's reading of the titles
make different mistakes.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from kvshard.datasets import load_dataset
from kvshard.models import model_template, resolve_model
from kvshard.prompts import PromptBuilder, RecommendationRequest, sample_requests
from kvshard.ranking import quality, standardized
from kvshard.splits import UserSplit, validation_requests
from kvshard_sidecar.engine import BlendEngine, MemoryBlockSource
from kvshard_sidecar.engine.isolated_scorer import Readout, scoring_prompt
from kvshard_sidecar.engine.model import load_model, read_identity
from kvshard_training.teacher import ItemKnnTeacher

CACHE = Path("/tmp/late_scorer_ensembles")
COMBINATIONS = ({"knn": 1.0}, {"late": 1.0}, {"scorer": 1.0}, {"scorer": 1.0, "knn": 1.0}, {"late": 1.0, "knn": 1.0},
                {"scorer": 1.0, "late": 1.0}, {"scorer": 1.0, "knn": 1.0, "late": 1.0})


def model_scores(spec: str, dataset_name: str, name: str, requests: list[RecommendationRequest]) -> list[list[float]]:
    """Each request's candidate scores by the merged scorer ``spec`` (cached per set and per weights hash, so
    a name such as ``late`` whose shipped adapter changes never reads the scores of the weights it replaced)."""
    path = resolve_model(spec)
    revision = read_identity(path, "float32").revision
    cache = CACHE / f"{spec.strip('/').replace('/', '_')}_{revision}_{name}.json"  # a folder spec too
    if cache.exists():
        cached: list[list[float]] = json.loads(cache.read_text())
        return cached
    loaded = load_model(path)
    readout = Readout.for_model(loaded.tokenizer, path)
    engine = BlendEngine(loaded.model, loaded.identity, MemoryBlockSource())
    builder = PromptBuilder(loaded.tokenizer, load_dataset(dataset_name), template=model_template(path))
    started, out = time.perf_counter(), []
    for request in requests:
        with torch.inference_mode():
            scored = engine.full(scoring_prompt(builder.build(request)), readout=readout).scores
        assert scored is not None
        out.append([float(s) for s in scored.tolist()])
    print(f"{spec} on {name}: {(time.perf_counter() - started) / len(requests):.2f} s/prompt", flush=True)
    CACHE.mkdir(exist_ok=True)
    cache.write_text(json.dumps(out))
    return out


def fused(scores: dict[str, list[list[float]]], weights: dict[str, float], request: int) -> list[float]:
    columns = [[weight * z for z in standardized(scores[name][request])] for name, weight in weights.items()]
    return [sum(column) for column in zip(*columns, strict=True)]


def paired_interval(differences: list[float], seed: int = 0, samples: int = 2000) -> tuple[float, float]:
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(differences, k=len(differences))) for _ in range(samples))
    return means[int(0.025 * samples)], means[int(0.975 * samples) - 1]


def paired_line(first: str, second: str, differences: list[float], metric: str = "HR@1") -> str:
    """``first − second`` per request: the mean, its 95 % bootstrap interval and, for a hit metric, on how
    many requests only one of the two ranks the target first."""
    low, high = paired_interval(differences)
    line = (f"  paired {first} - {second} {metric} {statistics.fmean(differences):+.3f} "
            f"(95 % CI {low:+.3f} .. {high:+.3f})")
    if metric != "HR@1":
        return line
    wins, losses = sum(d > 0 for d in differences), sum(d < 0 for d in differences)
    return f"{line}; only {first} first {wins}, only {second} {losses}"


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    dataset = load_dataset("movielens-100k")
    split = UserSplit()
    training_users = split.training_users(dataset)
    knn = ItemKnnTeacher(dataset.histories, training_users)
    sets = {"held-out": sample_requests(split.heldout_dataset(dataset), 191, 10, 20, 0),
            "validation": validation_requests(dataset, training_users, 10, 20, 96, 1)}
    for name, requests in sets.items():
        scores = {"knn": [knn.scores(r.history, r.candidates, None if name == "held-out" else r.user_id)
                          for r in requests]}
        for spec in ("late", "scorer"):
            scores[spec] = model_scores(spec, dataset.name, name, requests)
        targets = [r.candidates.index(str(r.target)) for r in requests]
        print(f"== {name} ({len(requests)} requests)")
        hits: dict[str, list[float]] = {}
        for weights in COMBINATIONS:
            answers = [quality(fused(scores, weights, i), t) for i, t in enumerate(targets)]
            label = " + ".join(weights)
            hits[label] = [a["hr1"] for a in answers]
            print(f"  {label:<20} HR@1 {statistics.fmean(hits[label]):.3f}  "
                  f"NDCG@10 {statistics.fmean(a['ndcg10'] for a in answers):.3f}")
        print(paired_line("late", "isolated", [a - b for a, b in zip(hits["late"], hits["scorer"], strict=True)]))


if __name__ == "__main__":
    main()
