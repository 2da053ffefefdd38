"""Isolating experiment (issue 42): where a late-scorer training step spends its time, part by part, and
whether taking the item bodies' gradient out of the adapted layers would buy examples.

The frozen-layer body cache (:class:`~kvshard_training.frozen_bodies.FrozenBodies`) removes ~40 % of the
rows from the 15 frozen layers, yet a step got only 1.02-1.06x faster (``training_step_rows.py``). This
script times the parts of the training loop's own step — the frozen layers' forward, the adapted layers'
forward, the backward, the optimizer — with forward hooks on the decoder layers, for:

* ``whole rows``: every row through every layer (no body cache);
* ``bodies cached`` (what ``kvshard model finetune`` does on the CPU): the frozen layers on the history and
  the readers only;
* ``bodies detached``: an approximation, not in the product — the bodies also pass the adapted layers
  alone, at the current weights but without a gradient (:class:`DetachedBodies`), so the step's forward
  and backward there run on the history and the readers only. The forward is the same (the scores are
  checked equal); the adapters lose the gradient through how an item is encoded;
* ``bodies stale`` (:class:`StaleBodies`, in the ``run`` form only): the bodies' adapted-layer keys and
  values kept and reused until ``REFRESH`` steps old, so most steps skip the bodies' pass too.

Examples: the shipped late recipe's first ``STEPS`` × 2 (``--batch 2``, float32, LoRA on the top 15 layers),
the body cache filled beforehand, each variant run ``ROUNDS`` times, interleaved; medians per example.

Run: ``cd bench/experiments && ../../.venv/bin/python training_step_profile.py [STEPS] [ROUNDS]`` (default
8 and 2; about 4 minutes on 2 idle cores). ``training_step_profile.py run MINUTES [REFRESH]`` trains the
shipped late recipe that long with the bodies detached (stale up to ``REFRESH`` steps where given:
:func:`detached_run`), to compare its loss curve with the shipped run's at equal steps (the same seed: the
same examples in the same order) and its adapter with the exact hour's. ``training_step_profile.py ops``
prints ``torch.profiler``'s operator table for four loop steps (:func:`operator_profile`).

Answer (2026-12-07, AVX2 AMD EPYC, float32): the frozen forward is a quarter of a step (whole rows .557 of
2.164 s per example), the cache cuts it to .354 (step 1.13x); the adapted layers' forward and backward are
70 %. Detached, the backward falls .850 -> .543 and the bodies' pass adds .106 to the forward: 1.14x over
the cache (1.02x in a first, quicker form an hour earlier). A 17-minute run learned as much per example
as the shipped run through its first 200 examples, at 1.08-1.10x the examples per second in the loop;
not adopted. Stale up to 64 steps (``run 56 64``): 2,390 examples in the hour (1.41 s each, ~1.46x the exact
step's), but a loss .09-.14 above the shipped run's at equal steps from step 500; alone HR@1 .340 on 300
validation prompts (the exact hour .303), .279 on the 955 held-out requests (isolated .338): not adopted.
``aten::mm`` is 68 % of a step (``ops``). docs/experiments.md has the tables.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from training_step_attention import adapted_model

from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, prompts_readout_scores
from kvshard_training.block_attention import attention_of
from kvshard_training.examples import Example, training_data
from kvshard_training.frozen_bodies import Body, FrozenBodies, _Recording, body_of
from kvshard_training.losses import batch_losses

PARTS = ("frozen forward", "adapted forward", "backward", "optimizer", "step")


class DetachedBodies(FrozenBodies):
    """The bodies through every layer without a gradient; the prompt's rows that read the history through
    every layer with one (their :class:`~kvshard_training.frozen_bodies.ReaderLayout` reading the bodies'
    keys and values at each layer)."""

    def scores(self, prompts: Sequence[IsolatedInputs], readout: int) -> list[torch.Tensor]:
        decoder, device = self.causal_lm.model, self.causal_lm.device
        bodies = self._through_adapted(self._bodies([body_of(p, b) for p in prompts for b in range(len(p.blocks))]))
        unused = torch.ones(len(prompts), 1, 1, 1, dtype=torch.bool, device=device)
        with attention_of(self.causal_lm):
            with torch.no_grad():
                (ids, positions), layout, gather = self._readers(prompts, bodies)
                hidden = decoder.embed_tokens(ids.to(device))
                embeddings = decoder.rotary_emb(hidden, position_ids=positions.to(device))
            for index, layer in enumerate(decoder.layers):
                with torch.set_grad_enabled(index >= self.frozen and torch.is_grad_enabled()):
                    hidden = layer(hidden, attention_mask=unused, position_ids=positions,
                                   position_embeddings=embeddings, block_layout=layout)
            rows = decoder.norm(hidden).reshape(-1, hidden.shape[-1])
        blanks = rows.new_zeros(sum(len(b.hidden) for b in bodies) + 1, rows.shape[-1])
        full = torch.cat([rows, blanks])[gather.to(device)].view(len(prompts), -1, rows.shape[-1])
        return prompts_readout_scores(self.causal_lm, prompts, full, readout)

    def _through_adapted(self, bodies: Sequence[Body]) -> list[Body]:
        """Each body's keys and values for every layer: the frozen ones cached, the adapted ones computed now
        (alone, from position 0, pads at the end, no gradient)."""
        decoder = self.causal_lm.model
        distinct = list({id(body): body for body in bodies}.values())
        hidden = pad_sequence([b.hidden for b in distinct], batch_first=True)
        hidden = F.pad(hidden, (0, 0, 0, max(0, 1 - hidden.shape[1])))
        positions = torch.arange(hidden.shape[1])[None].expand(len(hidden), -1)
        recording = _Recording()
        unused = torch.ones(len(hidden), 1, 1, 1, dtype=torch.bool)
        with torch.no_grad(), attention_of(self.causal_lm):
            embeddings = decoder.rotary_emb(hidden, position_ids=positions)
            for layer in decoder.layers[self.frozen:]:
                hidden = layer(hidden, attention_mask=unused, position_ids=positions,
                               position_embeddings=embeddings, block_layout=recording)
        keys = torch.stack([recording.keys[i] for i in sorted(recording.keys)], dim=1)
        values = torch.stack([recording.values[i] for i in sorted(recording.values)], dim=1)
        continued = {id(b): Body(torch.cat([b.keys, keys[row, :, :, :len(b.hidden)]]),
                                 torch.cat([b.values, values[row, :, :, :len(b.hidden)]]), b.hidden)
                     for row, b in enumerate(distinct)}
        return [continued[id(b)] for b in bodies]


class StaleBodies(DetachedBodies):
    """:class:`DetachedBodies` whose adapted-layer keys and values are kept and reused until they are
    ``refresh`` training passes old (then computed again at the current weights): a further approximation,
    the bodies read as the adapter encoded them up to ``refresh`` steps ago."""

    refresh = 64

    def __init__(self, causal_lm: Any, capacity: int) -> None:
        super().__init__(causal_lm, capacity)
        self.passes = 0
        # id(frozen body) -> (pass, frozen body, continued); the frozen body is held so that its id is not reused
        self.adapted: dict[int, tuple[int, Body, Body]] = {}

    def scores(self, prompts: Sequence[IsolatedInputs], readout: int) -> list[torch.Tensor]:
        self.passes += torch.is_grad_enabled()
        return super().scores(prompts, readout)

    def _through_adapted(self, bodies: Sequence[Body]) -> list[Body]:
        distinct = list({id(body): body for body in bodies}.values())
        stale = [b for b in distinct if id(b) not in self.adapted
                 or self.passes - self.adapted[id(b)][0] >= self.refresh]
        if stale:
            for frozen, continued in zip(stale, super()._through_adapted(stale), strict=True):
                self.adapted[id(frozen)] = (self.passes, frozen, continued)
        return [self.adapted[id(b)][2] for b in bodies]


class LayerClock:
    """Seconds spent in the decoder layers' forward, frozen and adapted apart (forward hooks)."""

    def __init__(self, causal_lm: Any, frozen: int) -> None:
        self.seconds = {"frozen forward": 0.0, "adapted forward": 0.0}
        self._started: dict[int, float] = {}
        for index, layer in enumerate(causal_lm.model.layers):
            part = "frozen forward" if index < frozen else "adapted forward"
            layer.register_forward_pre_hook(self._enter(index), with_kwargs=True)
            layer.register_forward_hook(self._leave(index, part), with_kwargs=True)

    def _enter(self, index: int) -> Any:
        def hook(*_: Any) -> None:
            self._started[index] = time.perf_counter()
        return hook

    def _leave(self, index: int, part: str) -> Any:
        def hook(*_: Any) -> None:
            self.seconds[part] += time.perf_counter() - self._started[index]
        return hook

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def timed_steps(causal_lm: Any, trainable: list[torch.Tensor], examples: Sequence[Example], settings: Any,
                readout: int, bodies: FrozenBodies | None, clock: LayerClock) -> dict[str, list[float]]:
    """The loop's steps (``--batch 2 --accumulation 2``: one pass each), each part's seconds per example."""
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr)
    parts: dict[str, list[float]] = {name: [] for name in PARTS}
    for start in range(0, len(examples), 2):
        batch = examples[start:start + 2]
        clock.reset()
        began = time.perf_counter()
        losses = batch_losses(causal_lm, batch, settings, readout, None, bodies)
        forward = time.perf_counter()
        torch.autograd.backward(torch.stack(losses).sum() / len(batch))
        backward = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(trainable, settings.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ended = time.perf_counter()
        for name, seconds in (*clock.seconds.items(), ("backward", backward - forward),
                              ("optimizer", ended - backward), ("step", ended - began)):
            parts[name].append(seconds / len(batch))
    return parts


def main(steps: int = 8, rounds: int = 2) -> None:
    torch.set_num_threads(2)
    causal_lm, trainable, recipe, tokenizer, readout = adapted_model(15, "float32")
    settings = replace(recipe, steps=steps, accumulation=2, batch=2, val_users=2)
    examples = training_data(settings, tokenizer).examples
    cached = FrozenBodies(causal_lm, 1 << 30)
    detached = DetachedBodies(causal_lm, 1 << 30)
    detached.bodies = cached.bodies  # one cache, filled once
    with torch.no_grad():
        for first in range(0, len(examples), 2):
            shipped = batch_losses(causal_lm, examples[first:first + 2], settings, readout, None, cached)
            approximated = batch_losses(causal_lm, examples[first:first + 2], settings, readout, None, detached)
            difference = max(abs(float(a - b)) for a, b in zip(shipped, approximated, strict=True))
            assert difference < 1e-4, difference
    print(f"{len(examples)} examples, {cached.frozen} frozen layers, {len(cached.bodies)} bodies cached; "
          f"bodies detached: the same losses (float32)")
    variants = {"whole rows": None, "bodies cached": cached, "bodies detached": detached}
    clock = LayerClock(causal_lm, cached.frozen)
    state = [t.detach().clone() for t in trainable]
    measured: dict[str, dict[str, list[float]]] = {name: {part: [] for part in PARTS} for name in variants}
    for _ in range(rounds):
        for name, bodies in variants.items():
            with torch.no_grad():
                for tensor, saved in zip(trainable, state, strict=True):
                    tensor.copy_(saved)
            for part, seconds in timed_steps(causal_lm, trainable, examples, settings, readout, bodies,
                                             clock).items():
                measured[name][part].extend(seconds)
    print(f"seconds per example (median of {len(examples) // 2 * rounds} steps of 2):")
    print(f"  {'':<16}" + "".join(f"{part:>17}" for part in PARTS) + "        vs whole")
    whole = statistics.median(measured["whole rows"]["step"])
    for name, parts in measured.items():
        medians = [statistics.median(parts[part]) for part in PARTS]
        print(f"  {name:<16}" + "".join(f"{m:>17.3f}" for m in medians) + f"{whole / medians[-1]:>13.2f}x")


def operator_profile(steps: int = 4) -> None:
    """``torch.profiler``'s table of the operators of ``steps`` loop steps (bodies cached, ``--batch 2``),
    after two steps that fill the cache: which kernels a step's seconds are spent in."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(2)
    causal_lm, trainable, recipe, tokenizer, readout = adapted_model(15, "float32")
    settings = replace(recipe, steps=steps + 2, accumulation=2, batch=2, val_users=2)
    examples = training_data(settings, tokenizer).examples
    bodies = FrozenBodies(causal_lm, 1 << 30)
    clock = LayerClock(causal_lm, bodies.frozen)
    timed_steps(causal_lm, trainable, examples[:4], settings, readout, bodies, clock)
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        parts = timed_steps(causal_lm, trainable, examples[4:], settings, readout, bodies, clock)
    print(f"{statistics.mean(parts['step']):.3f} s per example over {steps} steps of 2")
    print(profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def detached_run(minutes: float, refresh: int = 0) -> None:
    """``kvshard model finetune`` of the shipped late recipe (``--batch 2 --val-users 96``, its seed: the
    shipped run's examples in its order) for ``minutes``, :class:`DetachedBodies` in place of the body cache
    (``refresh`` > 0: :class:`StaleBodies` of that age); the loss curve in ``<user cache>/finetune/late-
    detached`` (``late-stale-REFRESH``) compares step by step with the shipped adapter's."""
    from kvshard.paths import cache_dir
    from kvshard_training import finetune
    from kvshard_training.settings import FinetuneSettings

    logging.basicConfig(level=logging.INFO)
    StaleBodies.refresh = refresh
    finetune.FrozenBodies = StaleBodies if refresh > 0 else DetachedBodies  # type: ignore[misc]
    name = f"late-stale-{refresh}" if refresh > 0 else "late-detached"
    finetune.train(FinetuneSettings(out=cache_dir() / "finetune" / name, history=10, candidates=20,
                                    label_position="after", steps=1436, accumulation=2, batch=2, minutes=minutes,
                                    layers=15, val_users=96, scorer="late", interaction=4), progress=False)


if __name__ == "__main__":
    if sys.argv[1:2] == ["ops"]:
        operator_profile()
    elif sys.argv[1:2] == ["run"]:
        detached_run(float(sys.argv[2]), *(int(n) for n in sys.argv[3:4]))
    else:
        main(*(int(n) for n in sys.argv[1:3]))
