"""Isolating experiment (issue 20): does the order dependence come from candidates reading each other?

Under the causal mask every candidate's item and label tokens attend to the candidates before it, so a
candidate's state — and the label the answer points through — changes with what stands before it; its
rotary distance to the history changes with its place too. Two masks separate the two causes without
retraining (the shipped recommender, full prefill, the bench's sample: held-out users' last items, 3
candidate orders each, the same seeds, summarised with the bench's own :func:`summarize`):

* ``causal`` — the prompt as served (must reproduce ``kvshard bench recommender``);
* ``isolated`` — each candidate (its item and its label) attends to the prefix (system, history, the
  ``Candidates:`` header) and to itself only; positions as served. The question and answer still read
  everything. What is left of the order dependence is the candidates' places (rotary distances) and the
  answer position's reading of the list;
* ``isolated+same positions`` — as ``isolated``, and every candidate starts at the same position (the end
  of the prefix), the question after the longest candidate: a candidate's state no longer depends on its
  place at all (Parallel Context Windows, Ratner et al. 2023), only its label letter does.

This is also what kvshard's blocks compute: an item block never sees the other candidates, and a block
cached at one position and placed at another is what re-rotation undoes — so a recommender trained this
way would be one whose answer blending can reproduce.

Run: ``.venv/bin/python bench/experiments/candidate_isolation.py [USERS] [MODEL]`` (default 100 users and
the prepared fine-tuned model; 3 orders × 3 variants per user, ~1 s each on 2 cores).

Answer (2026-12-02, the shipped adapter, 60 held-out users): causal HR@1 .256, consistency .42 (the bench's
picture); isolated .156 / .20; isolated+same positions .178 / .38. Cut off from each other the candidates
lose a third of HR@1 (the model was trained reading them in a list), and with every candidate at the same
positions — a candidate's state now a function of its item and its *letter* only — the answer still
changes for 62 % of users: the letters alone scramble it. The item signal is small next to item × letter
noise, so a recommender that must be order-free should not score through a letter at all:
``kvshard model finetune --scorer isolated`` trains one that scores each candidate before its letter.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from tqdm import tqdm

from kvshard.datasets import load_dataset
from kvshard.models import model_template, resolve_model
from kvshard.prompts import PromptBuilder, RecommendationPrompt, sample_requests
from kvshard.splits import UserSplit
from kvshard_bench.recommender import Answers, format_table, permutations, sample_line
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs
from kvshard_sidecar.engine.model import load_model

USERS = int(sys.argv[1]) if len(sys.argv) > 1 else 100
PATH = Path(sys.argv[2]) if len(sys.argv) > 2 else resolve_model("finetuned")
HISTORY, CANDIDATES, ORDERS, SEED = 10, 20, 3, 0
VARIANTS = ("causal", "isolated", "isolated+same positions")


def candidate_blocks(built: RecommendationPrompt) -> tuple[int, list[tuple[int, int]], int]:
    """(end of the prefix, [start, end) of each candidate — its item and the label after it —, start of
    the question): the isolated scorer's blocks."""
    inputs = IsolatedInputs.of(built)
    return inputs.prefix, list(inputs.blocks), inputs.blocks[-1][1]


def mask_and_positions(built: RecommendationPrompt, variant: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    total = len(built.prompt)
    if variant == "causal":
        return None, None
    prefix, blocks, question = candidate_blocks(built)
    allowed = torch.ones(total, total, dtype=torch.bool).tril()
    positions = torch.arange(total)
    for start, end in blocks:
        allowed[start:end, prefix:start] = False  # not the candidates before it
    if variant == "isolated+same positions":
        longest = max(end - start for start, end in blocks)
        for start, end in blocks:
            positions[start:end] = torch.arange(prefix, prefix + end - start)
        positions[question:] = torch.arange(prefix + longest, prefix + longest + total - question)
    return allowed[None, None], positions[None]


loaded = load_model(PATH)
model = loaded.model
dataset = load_dataset("movielens-100k")
builder = PromptBuilder(loaded.tokenizer, dataset, template=model_template(PATH))
if not builder.template.label_after:
    raise SystemExit("the candidate blocks here are '<item> [label]': use a model trained with the label after")
requests = sample_requests(UserSplit().heldout_dataset(dataset), USERS, HISTORY, CANDIDATES, SEED)
orders = permutations(requests, ORDERS, SEED)

answers = Answers(VARIANTS)
with tqdm(total=len(requests) * ORDERS * len(VARIANTS), desc="prompts") as bar:
    for user_orders in orders:
        answers.next_user()
        for request in user_orders:
            built = builder.build(request)
            ids = torch.tensor([built.prompt.token_ids])
            for variant in VARIANTS:
                mask, positions = mask_and_positions(built, variant)
                with torch.inference_mode():
                    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                   logits_to_keep=1).logits[0, -1]
                answers.add(variant, built, logits[list(built.label_token_ids)].tolist())
                bar.update()

print(sample_line(len(requests), CANDIDATES, HISTORY, ORDERS))
print(format_table(answers.rows(SEED, prefix=f"{PATH.name}: "), CANDIDATES, ORDERS))
