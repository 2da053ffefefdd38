"""Isolating experiment (issue 20): why `kvshard demo`'s rankings sit near random while the bench's do not.

`kvshard demo --model late --requests 80 --no-ramp` (2026-12-03) measured HR@1 .03 / HR@5 .20 / NDCG@10
.23 on its replay (random: .05 / .25 / .23) — full prefill re-sent the same (20 requests: .00 / .10), so
blending is not the cause — while `kvshard bench recommender` gave the same model .288 / .670 / .563 on
held-out users (a later three-run late adapter: .346 / .775 / .606 on the bench, .06 / .24 / .25 on the
demo's replay). The two differ in the negatives: the bench draws 19 items the user never saw, uniformly;
the demo's trace (:mod:`kvshard_bench.demo_trace`) draws them from the neighbourhood of the user's recent
items, weighted by popularity (∝ 1/rank), as a retrieval stage would. A recommender trained on uniform
negatives leans on popularity, which such negatives cancel. This script needs no model: it ranks the
candidates by popularity alone (rating count over every user) on both kinds of request, same users.

Run: ``.venv/bin/python bench/experiments/demo_trace_difficulty.py [REQUESTS]`` (default 400).

Answer (2026-12-03, 400 requests of 40 users): popularity ranks the bench's uniform negatives at HR@1 .260 /
HR@5 .690 / NDCG@10 .548 and the demo's at .028 / .128 / .141 — below random (.05 / .25 / .23). The demo's
negatives are exactly the popular items a popularity-leaning model puts first; the trace, not the blend,
sets the demo's quality numbers (recorded in README, "The demo").
"""

from __future__ import annotations

import random
import sys
from collections import Counter

from kvshard.datasets import load_dataset
from kvshard.ranking import quality, random_quality
from kvshard_bench.demo_trace import DemoTrace, DemoTraceSettings, ItemSpace
from kvshard_operator.embedding import embed_catalog

REQUESTS = int(sys.argv[1]) if len(sys.argv) > 1 else 400

dataset = load_dataset("movielens-100k")
popularity = Counter(item for history in dataset.histories.values() for item in history)
settings = DemoTraceSettings(users=40, requests_per_user=max(1, REQUESTS // 40))
ids = sorted(dataset.items)
space = ItemSpace.build(dataset, embed_catalog(ids, [dataset.items[i].text for i in ids]), settings, ids)
trace = DemoTrace(dataset, space, settings)
rng = random.Random(0)


def by_popularity(candidates: tuple[str, ...] | list[str], target: str) -> dict[str, float]:
    """Quality of ranking ``candidates`` by rating count (ties: item id)."""
    ordered = list(candidates)
    return quality([popularity[item] - 1e-9 * k for k, item in enumerate(ordered)], ordered.index(target))


rows: dict[str, list[dict[str, float]]] = {"demo trace (popular neighbours)": [], "uniform unseen (the bench's)": []}
for _ in range(len(trace)):
    request = trace.next()
    rows["demo trace (popular neighbours)"].append(by_popularity(request.candidates, request.target))
    seen = set(dataset.histories[request.user])
    negatives = rng.sample(sorted(set(ids) - seen), len(request.candidates) - 1)
    rows["uniform unseen (the bench's)"].append(by_popularity([request.target, *negatives], request.target))

print(f"popularity ranking, {len(trace)} requests of {len(trace.sessions)} users, 20 candidates")
print(f"{'negatives':34} {'HR@1':>6} {'HR@5':>6} {'NDCG@10':>8}")
for name, scores in rows.items():
    mean = {key: sum(s[key] for s in scores) / len(scores) for key in ("hr1", "hr5", "ndcg10")}
    print(f"{name:34} {mean['hr1']:6.3f} {mean['hr5']:6.3f} {mean['ndcg10']:8.3f}")
chance = random_quality(20)
print(f"{'random':34} {chance['hr1']:6.3f} {chance['hr5']:6.3f} {chance['ndcg10']:8.3f}")
