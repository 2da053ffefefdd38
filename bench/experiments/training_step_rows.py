"""Isolating experiment (issue 42): which rows does a late-scorer training step compute for nothing?

The late scorer's hour is compute-bound, and on an AVX2-only CPU (float32: bfloat16 is emulated there) it
buys ~1,400 examples of the shipped recipe where the shipped adapter saw 2,872. Two kinds of rows cost a
step without changing what it computes:

* a candidate's block is its item, then its label ``" [A]\\n"``, and the score is read at the label opening
  ``" ["``: the letter, ``"]"`` and the newline after it are read by nothing (blocks never read each
  other), yet the forward and the backward compute them
  (:meth:`~kvshard_sidecar.engine.isolated_scorer.IsolatedInputs.ending_at_openings` cuts them);
* below the first LoRA layer nothing trains, and a late scorer's item body (its tokens but the last
  ``interaction``) reads only its item: its rows there are the same in every prompt and at every step
  (:class:`~kvshard_training.frozen_bodies.FrozenBodies` computes each once and reads it after).

This script builds the shipped late recipe's first ``STEPS`` × 2 training examples twice — with whole blocks
(as before this change) and cut at their openings — checks that every variant gives the same losses and
gradients (float32), and then times the training loop's own optimizer steps (``losses.batch_losses``, the
backward, clipping, AdamW; LoRA on the top 15 layers, float32) four ways, interleaved ``ROUNDS`` times:
whole blocks one example per forward pass (the loop before this change, ``--batch 1``), cut blocks, cut
blocks with the bodies read from the frozen layers' cache (filled beforehand, as it is after a training
run's first few hundred examples), and that with both examples of a step in one pass (``--batch 2``).

Run: ``.venv/bin/python bench/experiments/training_step_rows.py [STEPS] [ROUNDS]`` (default 6 and 3; about
6 minutes on 2 idle cores).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any
from unittest import mock

import torch
from training_step_attention import adapted_model

from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs
from kvshard_training.examples import Example, training_data
from kvshard_training.finetune import optimizer_step
from kvshard_training.frozen_bodies import FrozenBodies
from kvshard_training.losses import batch_losses
from kvshard_training.settings import FinetuneSettings


def optimizer_steps(causal_lm: Any, trainable: list[torch.Tensor], examples: Sequence[Example],
                    settings: FinetuneSettings, readout: int, bodies: FrozenBodies | None) -> list[float]:
    """What ``kvshard model finetune`` does per step, for every step of ``examples``: the losses, the
    backward, clipping and an AdamW step (a fresh optimizer: its state is not what is timed). Returns the
    step losses."""
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr)
    return [optimizer_step(causal_lm, optimizer, trainable, examples[start:start + settings.accumulation], settings,
                           readout, None, bodies)
            for start in range(0, len(examples), settings.accumulation)]


def gradients(causal_lm: Any, trainable: list[torch.Tensor], examples: Sequence[Example],
              settings: FinetuneSettings, readout: int, bodies: FrozenBodies | None) -> tuple[list[float],
                                                                                            list[torch.Tensor]]:
    """Each example's loss and the summed gradient of them all, at the current weights."""
    losses = [batch_losses(causal_lm, [e], settings, readout, None, bodies)[0] for e in examples]
    return [float(loss.detach()) for loss in losses], list(torch.autograd.grad(torch.stack(losses).sum(), trainable))


def main(steps: int = 6, rounds: int = 3) -> None:
    torch.set_num_threads(2)
    causal_lm, trainable, recipe, tokenizer, readout = adapted_model(15, "float32")
    settings = replace(recipe, steps=steps, val_users=2, batch=1)
    cut = training_data(settings, tokenizer).examples
    with mock.patch.object(IsolatedInputs, "ending_at_openings", lambda inputs: inputs):
        whole = training_data(settings, tokenizer).examples
    bodies = FrozenBodies(causal_lm, 1 << 30)
    variants: dict[str, tuple[Sequence[Example], FinetuneSettings, FrozenBodies | None]] = {
        "whole blocks, 1 per pass": (whole, settings, None), "cut, 1 per pass": (cut, settings, None),
        "cut, bodies cached, 1 per pass": (cut, settings, bodies),
        "cut, bodies cached, 2 per pass": (cut, replace(settings, batch=2), bodies)}
    reference, reference_grads = gradients(causal_lm, trainable, whole, settings, readout, None)
    for name, (examples, each, cache) in list(variants.items())[1:]:
        losses, grads = gradients(causal_lm, trainable, examples, each, readout, cache)
        loss_diff = max(abs(a - b) for a, b in zip(reference, losses, strict=True))
        grad_diff = max(float((a - b).norm() / a.norm()) for a, b in zip(reference_grads, grads, strict=True))
        print(f"float32, {len(examples)} examples: {name} − whole blocks: max |loss| {loss_diff:.1e} "
              f"(losses ~{statistics.mean(reference):.1f}), gradient relative {grad_diff:.1e}")
    print(f"{bodies.frozen} frozen layers, {len(bodies.bodies)} bodies cached ({bodies.nbytes / 2**20:.0f} MiB)")
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    state = [t.detach().clone() for t in trainable]
    for _ in range(rounds):
        for name, (examples, each, cache) in variants.items():
            with torch.no_grad():
                for tensor, saved in zip(trainable, state, strict=True):
                    tensor.copy_(saved)
            started = time.perf_counter()
            optimizer_steps(causal_lm, trainable, examples, each, readout, cache)
            seconds[name].append((time.perf_counter() - started) / len(examples))
    base = statistics.median(seconds["whole blocks, 1 per pass"])
    for name, times in seconds.items():
        tokens = statistics.mean(e.tokens for e in variants[name][0])
        print(f"  {name:<31} {tokens:.0f} tokens per prompt, {statistics.median(times):.2f} s per example "
              f"(median of {rounds}), {base / statistics.median(times):.2f}x")


if __name__ == "__main__":
    main(*(int(n) for n in sys.argv[1:3]))
