"""Experiment (issue 20): how much of the isolated scorer survives item blocks that never read the history?

The isolated scorer (``kvshard model finetune --scorer isolated``) lets every candidate's item tokens read
the prefix (system, history, header). Served from kvshard's cache, an item block is prefilled without the
user's history; if the item tokens read only themselves and the one ``" ["`` that opens the label reads the
prefix and the item, that block — re-rotated behind the prefix — is exact, and a request costs one
recomputed token per candidate (CacheBlend at r ≈ 0, with no blending error). This asks what that mask
costs a scorer trained with the other one: per held-out user (the bench's sample and first candidate
order), the scores under both masks, their HR@1/HR@5/NDCG@10, the share of users whose first choice agrees
and the mean Kendall τ between the two rankings.

Run: ``.venv/bin/python bench/experiments/scorer_from_cache.py [USERS] [MODEL]`` (default all 191
held-out users and the prepared ``scorer``; float32, two forward passes per user).

Answer (2026-12-02, the shipped ``movielens-scorer`` adapter, all 191 held-out users): as trained HR@1 .361
(.29–.43), HR@5 .728, NDCG@10 .610; items alone HR@1 .094 (.05–.14), HR@5 .356, NDCG@10 .315; the first
choice agrees for .147 of users, mean Kendall τ .231. The item tokens' reading of the history carries the
ranking: a scorer trained this way cannot be served from exact item blocks with only its readout
recomputed; blending its item blocks, or training under the cache-exact mask, is the way on.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from kvshard.datasets import load_dataset
from kvshard.models import model_template, resolve_model
from kvshard.prompts import PromptBuilder, sample_requests
from kvshard.ranking import best_index, kendall_tau
from kvshard.splits import UserSplit
from kvshard_bench.recommender import Answers, format_table, sample_line
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, isolated_scores, readout_id
from kvshard_sidecar.engine.model import load_model

USERS = int(sys.argv[1]) if len(sys.argv) > 1 else 191
PATH = Path(sys.argv[2]) if len(sys.argv) > 2 else resolve_model("scorer")
HISTORY, CANDIDATES, SEED = 10, 20, 0
VARIANTS: dict[str, int | None] = {"items read the prefix (as trained)": None, "items alone (exact from cache)": 0}

torch.set_num_threads(2)
loaded = load_model(PATH)
readout = readout_id(loaded.tokenizer)
dataset = load_dataset("movielens-100k")
builder = PromptBuilder(loaded.tokenizer, dataset, template=model_template(PATH))
requests = sample_requests(UserSplit().heldout_dataset(dataset), USERS, HISTORY, CANDIDATES, SEED)
answers = Answers(list(VARIANTS))
same_choice: list[float] = []
taus: list[float] = []
for request in tqdm(requests, desc="held-out users"):
    answers.next_user()
    built = builder.build(request)
    scored = {}
    with torch.inference_mode():
        for name, interaction in VARIANTS.items():
            scored[name] = isolated_scores(loaded.model, IsolatedInputs.of(built, interaction), readout).tolist()
            answers.add(name, built, scored[name])
    trained, cached = scored.values()
    same_choice.append(float(best_index(trained) == best_index(cached)))
    taus.append(kendall_tau(trained, cached))
print(sample_line(len(requests), CANDIDATES, HISTORY, 1))
print(format_table(answers.rows(SEED), CANDIDATES, 1))
print(f"first choice agrees for {statistics.fmean(same_choice):.3f} of users; "
      f"mean Kendall tau {statistics.fmean(taus):.3f}")
