"""Isolating experiment (issue 42): why did training on retrieval-stage negatives rank retrieval-stage
candidates *worse than random*?

`kvshard model finetune … --hard-negatives 0.5` (the shipped late recipe otherwise, 56 minutes) drew half
of each training prompt's negatives from the retrieval stage — the items that co-occur most with the shown
history — and kept the target whatever the stage thought of it. On the held-out retrieval-stage candidates
(`kvshard bench recommender --candidate-set retrieval`) the model then reranked below a random order
(NDCG@10 .042 against .048). The hypothesis: a selection mismatch. In training the target is *any* next
interaction and the hard negatives are the stage's best guesses, so the stage's own score (co-occurrence
with the history) is higher for the negatives than for the target — a model learns to prefer what the stage
does *not* retrieve. In the benchmark only a target the stage retrieved can be ranked at all, and it is
there because its co-occurrence is high. This script measures both sides, model-free:

* training (the run's own requests, same seed and share): how often the target's stage score is below
  every hard negative's, and the target's mean rank by stage score among the candidates;
* benchmark (held-out users' last items, the bench's sample): where the retrieved targets sit in the stage's
  order.

Run: ``.venv/bin/python bench/experiments/hard_negative_selection.py [MODEL ...]`` (~1 min without
models). Each MODEL (``late`` or a merged folder) then scores the first 60 benchmark requests, and the
script prints the mean Kendall τ between its scores and the stage's over each request's candidates.

Answer (2026-12-05; the two models on the first 60 benchmark requests):

    training requests (4,000, hard share 0.5: 10 of 19 negatives from the stage)
      target's stage score below every hard negative's: 71.9 %
      target's mean rank by stage score among the 20 candidates: 8.6 (0 = best); hard negatives 4.7
    benchmark (191 held-out users, 40 targets retrieved)
      retrieved target's mean rank in the stage's order: 6.8 of 20
      late (shipped, uniform negatives): mean Kendall τ with the stage's scores +0.159
      late, --hard-negatives 0.5:        mean Kendall τ with the stage's scores +0.081

In training, the stage's score ranks the hard negatives (4.7) *above* the target (8.6) in most examples,
even though the stage's counts include the training user's own interactions: the stage's signal points
away from the answer there, and the model trained on them agrees with the stage half as much as the shipped
one. In the benchmark a target can only be ranked if the stage retrieved it, and then it sits in the upper
part of the stage's order (6.8 of 20): the signal the hard negatives trained away is the one that finds it.
(Below random is itself within noise: NDCG@10 .198 against .227 over 40 retrieved targets.) Training for
a retrieval stage's output has to keep its selection — the stage's candidates as served, with the target
only where the stage retrieved it — not the target inserted among the stage's favourites.
"""

from __future__ import annotations

import statistics
import sys

import torch

from kvshard.datasets import load_dataset
from kvshard.models import model_template, resolve_model
from kvshard.prompts import PromptBuilder
from kvshard.ranking import kendall_tau
from kvshard.retrieval import RetrievalIndex, RetrievedRequest, retrieval_requests
from kvshard.splits import UserSplit, training_requests
from kvshard_sidecar.engine import BlendEngine, MemoryBlockSource
from kvshard_sidecar.engine.isolated_scorer import Readout, scoring_prompt
from kvshard_sidecar.engine.model import load_model


def rank_among(scores: list[float], index: int) -> int:
    mine = scores[index]
    return sum(1 for i, s in enumerate(scores) if s > mine or (s == mine and i < index))


def main() -> None:
    dataset = load_dataset("movielens-100k")
    split = UserSplit()
    index = RetrievalIndex.fit(dataset, split)
    users = split.training_users(dataset)
    requests = training_requests(dataset, users, 10, 20, 4000, 0, 30, index.hard_negatives, 0.5)
    below, target_ranks, hard_ranks = 0, [], []
    for request in requests:
        seen = dataset.histories[request.user_id]
        hard = set(index.hard_negatives(request.history, seen, 10))
        scores = index.scores(request.history, request.candidates)
        target = request.candidates.index(str(request.target))
        hard_scores = [s for c, s in zip(request.candidates, scores, strict=True) if c in hard]
        below += all(scores[target] < s for s in hard_scores)
        target_ranks.append(rank_among(scores, target))
        hard_ranks += [rank_among(scores, i) for i, c in enumerate(request.candidates) if c in hard]
    print(f"training requests ({len(requests)}, hard share 0.5)")
    print(f"  target's stage score below every hard negative's: {below / len(requests):.1%}")
    print(f"  target's mean rank by stage score: {statistics.fmean(target_ranks):.1f}; "
          f"hard negatives {statistics.fmean(hard_ranks):.1f}")
    stage = retrieval_requests(split.heldout_dataset(dataset), index, 191, 10, 20, 0)
    ranks = [r.retrieval_rank for r in stage if r.retrieval_rank is not None]
    print(f"benchmark ({len(stage)} held-out users, {len(ranks)} targets retrieved)")
    print(f"  retrieved target's mean rank in the stage's order: {statistics.fmean(ranks):.1f} of 20")
    for spec in sys.argv[1:]:
        print(f"  {spec}: mean Kendall tau with the stage's scores {agreement(spec, index, stage[:60]):+.3f}")


def agreement(spec: str, index: RetrievalIndex, stage: list[RetrievedRequest]) -> float:
    """Mean Kendall τ between a merged scorer's candidate scores and the stage's, per request."""
    path = resolve_model(spec)
    assert path is not None, f"{spec} is not prepared"
    loaded = load_model(path)
    readout = Readout.for_model(loaded.tokenizer, path)
    engine = BlendEngine(loaded.model, loaded.identity, MemoryBlockSource())
    builder = PromptBuilder(loaded.tokenizer, load_dataset("movielens-100k"), template=model_template(path))
    taus = []
    for retrieved in stage:
        request = retrieved.request
        with torch.inference_mode():
            scored = engine.full(scoring_prompt(builder.build(request)), readout=readout).scores
        assert scored is not None
        taus.append(kendall_tau(scored.tolist(), index.scores(request.history, request.candidates)))
    return statistics.fmean(taus)


if __name__ == "__main__":
    main()
