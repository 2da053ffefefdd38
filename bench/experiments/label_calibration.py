"""Isolating experiment (issue 20): how much of the recommender's position inconsistency is a fixed prior?

The fine-tuned recommender changes its first choice under another candidate order for 60 % of held-out
users (``kvshard bench recommender``: position consistency .40). If that were a *systematic* preference for
some places in the list, dividing it out would fix it at no training cost — contextual calibration (Zhao et
al. 2021, "Calibrate Before Use"): estimate the model's log-prior over the K labels and subtract it from
every answer's label log-probabilities. Here the prior is the mean label log-softmax over the *validation*
prompts of training users (their second-to-last items, never the benchmark's users or last items), each
under one random candidate order, so the item effects average out and what stays is the place.

Then the bench's own sample (held-out users' last items, 3 candidate orders each, the same seeds) is
scored raw and calibrated, side by side, with the bench's own summary (HR@1 with a bootstrap interval,
position consistency, most chosen letter).

Run: ``.venv/bin/python bench/experiments/label_calibration.py [USERS] [PRIOR_PROMPTS]`` (defaults 100 and
100: about 8 minutes on 2 cores). Its answer is in README's "Models" section.

Answer (2026-12-02, the shipped adapter): no. The log-prior per place is nearly flat (−3.01 … −3.54 against
ln(1/20) = −3.00: no letter the model prefers by much), the raw row reproduces the bench exactly (HR@1 .283,
consistency .40, most chosen letter 9 %), and calibrated is HR@1 .267 (.19–.33), consistency .43, 10 %. The
inconsistency is per request — small margins between the top candidates that a reorder flips — not a fixed
place preference that inference can divide out; it has to be trained away (more requests, or the
``--consistency`` term where compute allows).
"""
from __future__ import annotations

import random
import sys

import torch
from tqdm import tqdm

from kvshard.datasets import load_dataset
from kvshard.models import model_template, resolve_model
from kvshard.prompts import PromptBuilder, candidate_orders, sample_requests
from kvshard.ranking import QUALITY_METRICS, best_index, quality
from kvshard.splits import UserSplit, validation_requests
from kvshard_bench.recommender import permutations, summarize
from kvshard_sidecar.engine import BlendEngine, MemoryBlockSource
from kvshard_sidecar.engine.model import load_model

USERS = int(sys.argv[1]) if len(sys.argv) > 1 else 100
PRIOR_PROMPTS = int(sys.argv[2]) if len(sys.argv) > 2 else 100
HISTORY, CANDIDATES, ORDERS, SEED = 10, 20, 3, 0

path = resolve_model("finetuned")
loaded = load_model(path)
engine = BlendEngine(loaded.model, loaded.identity, MemoryBlockSource())
dataset = load_dataset("movielens-100k")
builder = PromptBuilder(loaded.tokenizer, dataset, template=model_template(path))
split = UserSplit()


def label_logprobs(request: object) -> tuple[list[float], object]:
    built = builder.build(request)  # type: ignore[arg-type]
    with torch.inference_mode():
        logits = engine.full(built.prompt).logits
    return torch.log_softmax(logits[list(built.label_token_ids)].float(), dim=-1).tolist(), built


rng = random.Random(f"{SEED}-prior")
prior_requests = [candidate_orders(r, 2, rng)[1] for r in validation_requests(
    dataset, split.training_users(dataset), HISTORY, CANDIDATES, PRIOR_PROMPTS, SEED + 7)]
totals = [0.0] * CANDIDATES
for request in tqdm(prior_requests, desc="prior (training users' validation prompts)"):
    logprobs, _ = label_logprobs(request)
    totals = [t + v for t, v in zip(totals, logprobs, strict=True)]
prior = [t / len(prior_requests) for t in totals]
print("log-prior per place (A..):", " ".join(f"{p:+.2f}" for p in prior))

requests = sample_requests(split.heldout_dataset(dataset), USERS, HISTORY, CANDIDATES, SEED)
orders = permutations(requests, ORDERS, SEED)
choices: dict[str, list[list[tuple[str, str]]]] = {"raw": [], "calibrated": []}
metrics: dict[str, list[list[dict[str, float]]]] = {"raw": [], "calibrated": []}
for user_orders in tqdm(orders, desc="held-out users"):
    for kind in choices:
        choices[kind].append([])
        metrics[kind].append([])
    for request in user_orders:
        logprobs, built = label_logprobs(request)
        for kind, scores in (("raw", logprobs), ("calibrated", [v - p for v, p in zip(logprobs, prior, strict=True)])):
            chosen = best_index(scores)
            choices[kind][-1].append((request.candidates[chosen], built.labels[chosen]))  # type: ignore[attr-defined]
            target = request.target_index
            metrics[kind][-1].append(quality(scores, target) if target is not None
                                     else dict.fromkeys(QUALITY_METRICS, 0.0))
print(f"{len(requests)} held-out users' last items, {CANDIDATES} candidates, history {HISTORY}, {ORDERS} orders, "
      f"prior from {len(prior_requests)} training users' validation prompts")
for kind in choices:
    row = summarize(choices[kind], metrics[kind], SEED)
    print(f"{kind:<11} HR@1 {row['hr1']:.3f} ({row['hr1_ci'][0]:.2f}–{row['hr1_ci'][1]:.2f})  HR@5 {row['hr5']:.3f}  "
          f"NDCG@10 {row['ndcg10']:.3f}  consistency {row['position_consistency']:.2f}  "
          f"most chosen letter {row['max_label_share']:.2f} ({row['max_label']})")
