"""Isolating experiment (issue 42): where does a late-scorer training step spend its time, and does an
attention that skips the masked pairs buy steps?

The late scorer's hour on this machine is compute-bound (continued training kept improving it), so a
cheaper step is a better model at the same budget. Its training forward feeds SDPA a dense [T, T] mask:
a causal prefix (system turn, history, ``Candidates:``; ~194 tokens) and 20 candidate blocks of ~18 tokens,
each reading the prefix (a late scorer's body rows not even that) and itself. About 87 % of the ~600²
pairs are masked, and the CPU kernel computes them all. This script

1. profiles one step of the shipped late recipe (4 examples, bf16 autocast, LoRA on the top ``LAYERS``)
   and prints the attention kernels' share of it;
2. checks that the block attention of :mod:`kvshard_training.block_attention` — computed from the layout
   instead: the prefix causally, every block against its own prefix and itself in batched matmuls — and
   SDPA's math backend give the dense mask's scores and gradients (float32);
3. times a forward + backward of the same 4 examples — dense (shipped), dense with SDPA's math backend
   (the same pairs, by the matmul kernels) and block — each one example per pass (the shipped
   ``--batch 1``) and four per pass (``--batch 4``), interleaved ``ROUNDS`` times.

Run: ``.venv/bin/python bench/experiments/training_step_attention.py [LAYERS] [ROUNDS]`` (default 15 and 3;
about 3 minutes on 2 idle cores).

Answer (2026-12-06, 2 cores, 15 LoRA layers; the machine was also scoring in the background at times, so
read the interleaved ratios, not the seconds):

    float32: block − dense max |score| 1.1e-05 (scores ~14), gradient relative 9.0e-06; math − dense 1.2e-05
    bf16 dense step: attention kernels 39 % of the profiled CPU time, matmuls 47 %
      dense, 1 per pass   5.52 s per 4 examples   1.00x (the shipped step)
      block, 1 per pass   4.70 s                  1.18x
      math, 1 per pass    5.61 s                  0.98x
      dense, 4 per pass   5.13 s                  1.08x
      math, 4 per pass    5.42 s                  1.02x
      block, 4 per pass   4.47 s                  1.24x

Again on idle cores (2026-12-06, 11:03): attention 39 %; dense 5.44 s, block 4.79 s (1.14x), math 0.94x,
dense 4 per pass 1.07x, block 4 per pass 1.26x — the loaded run's 1.18x was partly the load.

Computing the masked pairs is what costs, not the kernel that computes them (math ≈ dense); skipping them
buys about a sixth of a forward + backward, exactly (float32 differences at rounding). Fine-tuning on the
CPU now uses the block attention (:func:`kvshard_training.losses.batch_losses`); there a whole step
gained less, 1.06-1.07x (two 24-step ``kvshard model finetune`` probes in each order; docs/experiments.md),
and why the loop saves half the seconds this script does is not yet explained.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, batched_isolated_scores, readout_id
from kvshard_sidecar.engine.model import default_model_path, load_model
from kvshard_training.block_attention import block_scores
from kvshard_training.examples import training_data
from kvshard_training.lora import lora_model
from kvshard_training.merge import MOVIELENS_LATE_ADAPTER
from kvshard_training.report import PROVENANCE_FILE
from kvshard_training.settings import FinetuneSettings

Scorer = Callable[[Any, Sequence[IsolatedInputs], int], list[torch.Tensor]]


def math_scores(causal_lm: Any, prompts: Sequence[IsolatedInputs], readout: int) -> list[torch.Tensor]:
    """The shipped dense-mask scores with SDPA's math backend (matmul, softmax, matmul) instead of the
    CPU's tiled flash kernel: the same pairs computed, by the matmul kernels."""
    with sdpa_kernel(SDPBackend.MATH):
        return batched_isolated_scores(causal_lm, prompts, readout)


def step(causal_lm: Any, trainable: list[torch.Tensor], scorer: Scorer, prompts: Sequence[IsolatedInputs],
         per_pass: int, readout: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Scores and the gradients of a fixed linear function of them (every candidate weighted), ``per_pass``
    prompts per forward pass."""
    scores: list[torch.Tensor] = []
    grads = [torch.zeros_like(p) for p in trainable]
    for start in range(0, len(prompts), per_pass):
        part = scorer(causal_lm, prompts[start:start + per_pass], readout)
        loss = sum((s * torch.linspace(-1, 1, len(s))).sum() for s in part)
        for total, grad in zip(grads, torch.autograd.grad(loss, trainable), strict=True):
            total += grad
        scores.extend(s.detach() for s in part)
    return scores, grads


def adapted_model(layers: int, precision: str) -> tuple[Any, list[torch.Tensor], FinetuneSettings, Any, int]:
    """The base model with the shipped late recipe's LoRA on the top ``layers`` (random, so that it has a
    gradient path and an effect on the scores), its trainable tensors, the recipe, the tokenizer, the
    readout token."""
    recorded = json.loads((MOVIELENS_LATE_ADAPTER / PROVENANCE_FILE).read_text())["settings"]
    settings = FinetuneSettings.from_record({**recorded, "steps": 4, "val_users": 4, "layers": layers,
                                             "precision": precision, "out": None})
    loaded = load_model(default_model_path(), dtype=settings.precision, device="cpu")
    peft_model = lora_model(loaded.model, settings)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    torch.manual_seed(0)
    for parameter in trainable:  # B starts at 0: give the adapter a gradient path and an effect on the scores
        torch.nn.init.normal_(parameter, std=0.02)
    return peft_model.get_base_model(), trainable, settings, loaded.tokenizer, readout_id(loaded.tokenizer)


def setup(layers: int, precision: str) -> tuple[Any, list[torch.Tensor], list[IsolatedInputs], int]:
    causal_lm, trainable, settings, tokenizer, readout = adapted_model(layers, precision)
    data = training_data(settings, tokenizer)
    prompts = [inputs for example in data.examples[:4] for inputs in example.isolated]
    return causal_lm, trainable, prompts, readout


def main(layers: int = 15, rounds: int = 3) -> None:
    torch.set_num_threads(2)
    causal_lm, trainable, prompts, readout = setup(layers, "float32")
    dense, dense_grads = step(causal_lm, trainable, batched_isolated_scores, prompts, 4, readout)
    for name, scorer in (("block", block_scores), ("math", math_scores)):
        other, other_grads = step(causal_lm, trainable, scorer, prompts, 4, readout)
        score_diff = max(float((a - b).abs().max()) for a, b in zip(dense, other, strict=True))
        grad_diff = max(float((a - b).norm() / a.norm()) for a, b in zip(dense_grads, other_grads, strict=True))
        print(f"float32, {len(prompts)} prompts of {[len(p.token_ids) for p in prompts]} tokens: {name} − dense "
              f"max |score| {score_diff:.1e} (scores ~{float(dense[0].abs().mean()):.0f}), "
              f"gradient relative {grad_diff:.1e}")
    causal_lm, trainable, prompts, readout = setup(layers, "bfloat16")
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        step(causal_lm, trainable, batched_isolated_scores, prompts, 4, readout)
    events = profiled.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    attention = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key)
    matmul = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::bmm", "aten::addmm"))
    print(f"bf16 dense step, {layers} LoRA layers: attention kernels {attention / total:.0%} of the profiled CPU "
          f"time, matmuls {matmul / total:.0%}")
    variants: dict[str, tuple[Scorer, int]] = {"dense, 1 per pass": (batched_isolated_scores, 1),
                                               "block, 1 per pass": (block_scores, 1),
                                               "math, 1 per pass": (math_scores, 1),
                                               "dense, 4 per pass": (batched_isolated_scores, 4),
                                               "math, 4 per pass": (math_scores, 4),
                                               "block, 4 per pass": (block_scores, 4)}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (scorer, per_pass) in variants.items():
            started = time.perf_counter()
            step(causal_lm, trainable, scorer, prompts, per_pass, readout)
            seconds[name].append(time.perf_counter() - started)
    reference = statistics.median(seconds["dense, 1 per pass"])
    for name, times in seconds.items():
        print(f"  {name:<18} {statistics.median(times):.2f} s per 4 examples (median of {rounds}), "
              f"{reference / statistics.median(times):.2f}x the shipped step")


if __name__ == "__main__":
    main(*(int(n) for n in sys.argv[1:3]))
