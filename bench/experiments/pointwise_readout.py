"""Isolating experiment (issue 20): is the recommender's position inconsistency in the *readout*?

The answer is read at the answer position: the label logits after the question, which attend to every
candidate in the order they stand. ``kvshard model finetune --pointwise W`` also trains a second readout:
the logit of " yes" at each candidate's own label token, where the label has just read its item and none
of the candidates after it. If the order dependence came from the answer position weighing the list (a
late candidate is read last, an early one first), the pointwise scores should rank the same items under
any order far more often; if it comes from the items' own states (a candidate's state depends on the
candidates before it), both readouts should be about equally inconsistent.

Both readouts come from one forward pass per prompt (``answer_and_label_logits``, what training uses), on
the bench's own sample (held-out users' last items, 3 candidate orders each, the same seeds), summarised
with the bench's own :func:`summarize`.

Run: ``.venv/bin/python bench/experiments/pointwise_readout.py MODEL_FOLDER [USERS]`` (a model merged from
a ``--pointwise`` adapter, ``kvshard model merge``; default 100 users, ~1 s per prompt on 2 cores).

Answer (2026-12-02, the ``--pointwise 1`` adapter of README's "Models" section, all 191 held-out users):
the answer position reproduces the bench (HR@1 .260, HR@5 .611, consistency .41); the pointwise readout
is HR@1 .255, HR@5 .654, consistency .48 — a little steadier, far from .8. The order dependence is mostly
in the candidates' states (each has read the candidates before it), not in how the answer reads the list:
``candidate_isolation.py`` takes it from there.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from tqdm import tqdm

from kvshard.datasets import load_dataset
from kvshard.models import model_template
from kvshard.prompts import PromptBuilder, sample_requests
from kvshard.splits import UserSplit
from kvshard_bench.recommender import Answers, format_table, permutations, sample_line
from kvshard_sidecar.engine.isolated_scorer import readout_id
from kvshard_sidecar.engine.model import load_model
from kvshard_training.examples import label_positions
from kvshard_training.losses import answer_and_label_logits

PATH = Path(sys.argv[1])
USERS = int(sys.argv[2]) if len(sys.argv) > 2 else 100
HISTORY, CANDIDATES, ORDERS, SEED = 10, 20, 3, 0
READOUTS = ("answer position", "pointwise (own label)")

loaded = load_model(PATH)
dataset = load_dataset("movielens-100k")
builder = PromptBuilder(loaded.tokenizer, dataset, template=model_template(PATH))
if not builder.template.label_after:
    raise SystemExit("the pointwise readout needs a model trained with the label after its item")
readout = readout_id(loaded.tokenizer)
requests = sample_requests(UserSplit().heldout_dataset(dataset), USERS, HISTORY, CANDIDATES, SEED)
orders = permutations(requests, ORDERS, SEED)

answers = Answers(READOUTS)
with tqdm(total=len(requests) * ORDERS, desc="prompts") as bar:
    for user_orders in orders:
        answers.next_user()
        for request in user_orders:
            built = builder.build(request)
            ids = torch.tensor([built.prompt.token_ids])
            positions = torch.tensor([label_positions(built)])
            with torch.inference_mode():
                logits, pointwise = answer_and_label_logits(loaded.model, ids, positions, readout)
            assert pointwise is not None
            answers.add(READOUTS[0], built, logits[0, list(built.label_token_ids)].tolist())
            answers.add(READOUTS[1], built, pointwise[0].tolist())
            bar.update()

print(sample_line(len(requests), CANDIDATES, HISTORY, ORDERS))
print(format_table(answers.rows(SEED, prefix=f"{PATH.name}: "), CANDIDATES, ORDERS))
