"""Isolating experiment (issue 42): which rows does a late-scorer training step compute for nothing?

The late scorer's hour is compute-bound, and on an AVX2-only CPU (float32: bfloat16 is emulated there) it
buys ~1,400 examples of the shipped recipe where the shipped adapter saw 2,872. Two kinds of rows cost a
step without changing what it computes:

* a candidate's block is its item, then its label ``" [A]\n"``, and the score is read at the label opening
  ``" ["``: the letter, ``"]"`` and the newline after it are read by nothing (blocks never read each
  other), yet the forward and the backward compute them
  (:meth:`~kvshard_sidecar.engine.isolated_scorer.IsolatedInputs.ending_at_openings` cuts them);
* below the first LoRA layer nothing trains, and a late scorer's item body (its tokens but the last
  ``interaction``) reads only its item: its rows there are the same in every prompt and at every step
  (:class:`~kvshard_training.frozen_bodies.FrozenBodies` computes each once and reads it after).

This script takes the shipped late recipe's first training requests and times a forward + backward of them
(fine-tuning's block attention, float32, LoRA on the top 15 layers) three ways — whole blocks, blocks cut
at their openings, and cut blocks with the bodies read from the frozen layers' cache (filled by the first
pass, as in training after its first examples) — interleaved ``ROUNDS`` times, after checking that all
three give the same scores and gradients.

Run: ``.venv/bin/python bench/experiments/training_step_rows.py [EXAMPLES] [ROUNDS] [PER_PASS]`` (default 4,
5 and 1 — one example per forward pass, as ``kvshard model finetune --batch 1``; about 3 minutes on 2 idle
cores).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from training_step_attention import Scorer, adapted_model, step

from kvshard.datasets import load_dataset
from kvshard.prompt_template import PromptTemplate
from kvshard.prompts import PromptBuilder
from kvshard.splits import training_requests
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs
from kvshard_training.block_attention import block_scores
from kvshard_training.examples import split_users
from kvshard_training.frozen_bodies import FrozenBodies


def main(examples: int = 4, rounds: int = 5, per_pass: int = 1) -> None:
    torch.set_num_threads(2)
    causal_lm, trainable, settings, tokenizer, readout = adapted_model(15, "float32")
    dataset = load_dataset(settings.dataset)
    _, _, users = split_users(settings, dataset)
    builder = PromptBuilder(tokenizer, dataset, template=PromptTemplate(label_position="after"))
    requests = training_requests(dataset, users, settings.history, settings.candidates, examples, settings.seed,
                                 settings.window)
    whole = [IsolatedInputs.of(builder.build(r), settings.interaction) for r in requests]
    cut = [p.ending_at_openings() for p in whole]
    bodies = FrozenBodies(causal_lm, 1 << 30)
    variants: dict[str, tuple[Scorer, list[IsolatedInputs]]] = {
        "whole blocks": (block_scores, whole), "cut at openings": (block_scores, cut),
        "cut, bodies cached": (lambda _, prompts, token: bodies.scores(prompts, token), cut)}
    reference, reference_grads = step(causal_lm, trainable, block_scores, whole, per_pass, readout)
    for name, (scorer, prompts) in list(variants.items())[1:]:
        scores, grads = step(causal_lm, trainable, scorer, prompts, per_pass, readout)
        score_diff = max(float((a - b).abs().max()) for a, b in zip(reference, scores, strict=True))
        grad_diff = max(float((a - b).norm() / a.norm()) for a, b in zip(reference_grads, grads, strict=True))
        print(f"float32, {examples} prompts: {name} − whole blocks max |score| {score_diff:.1e} "
              f"(scores ~{float(reference[0].abs().mean()):.0f}), gradient relative {grad_diff:.1e}")
    print(f"{bodies.frozen} frozen layers, {len(bodies.bodies)} bodies cached ({bodies.nbytes / 2**20:.0f} MiB)")
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (scorer, prompts) in variants.items():
            started = time.perf_counter()
            step(causal_lm, trainable, scorer, prompts, per_pass, readout)
            seconds[name].append(time.perf_counter() - started)
    base = statistics.median(seconds["whole blocks"])
    for name, times in seconds.items():
        tokens = sum(len(p.token_ids) for p in variants[name][1]) / examples
        print(f"  {name:<18} {tokens:.0f} tokens per prompt, {statistics.median(times):.2f} s per {examples} "
              f"examples, {per_pass} per pass (median of {rounds}), {base / statistics.median(times):.2f}x")


if __name__ == "__main__":
    main(*(int(n) for n in sys.argv[1:4]))
