"""What a fine-tuning step computes, and how validation ranks the same prompts.

Why a module of its own: the loss is where the recommender's design lives, and the training loop
(:mod:`kvshard_training.finetune`), the fusion-weight fit (:mod:`kvshard_training.fusion_weight`) and the
experiments under ``bench/experiments`` all call the same functions, so what is trained, what is validated
and what is measured cannot drift apart.

* the loss is the cross-entropy over the candidates' *label tokens* at the answer position (the
  last prompt token), target = the held-out item's label — nothing else in the vocabulary, and no
  other position, contributes;
* candidate order is shuffled per example, so position carries no signal;
* optionally (the default) the one-hot target is mixed with an item-kNN teacher's distribution over
  every candidate (:mod:`kvshard_training.teacher`), a graded target for all K labels;
* optionally (``--consistency``) every request is trained under two candidate orders at once, and a
  symmetric KL between their per-item distributions (:func:`order_disagreement`) asks the model to
  rank the same items the same wherever they stand — shuffling alone only removes position as a
  *signal*; the agreement term targets it as a *bias*. Off by default: it halves the requests an
  hour buys, and measured at the same 54-minute budget it traded HR@1 .28 → .21 for position
  consistency .40 → .45 (README, "Models").
* optionally (``--pointwise``) each candidate's own label token is read too (one ``lm_head`` row,
  " yes", at K positions of the forward pass already made) and those K scores are trained to rank
  the candidates against the same target (:func:`mixed_cross_entropy`): K graded signals per request
  at no extra compute. Off by default: measured at a 50-minute budget it raised validation
  consistency (two orders .74 at step 403) but not held-out users' (README, "Models").
* optionally (``--retrieval-weight W``, isolated or late scorers) the loss reads the ranking as it is
  served behind a retrieval stage, ``z(scores) + W · z(stage score)`` (:func:`served_scores`), times one
  learned scale: the model learns what the stage misses. Off by default: at the shipped budget it served
  held-out users better and training users' next items no better, every paired interval holding 0
  (docs/experiments.md), and alone such a model ranks near chance.
* ``--scorer isolated`` trains the isolated scorer instead (:mod:`kvshard_sidecar.engine.isolated_scorer`):
  no answer position, each candidate scored alone from the prefix and its own item, the same mixed
  cross-entropy over the K scores. Its ranking cannot depend on the candidate order.

Only the scored positions go through ``lm_head`` (the answer position's label logits, or each candidate's
readout row), never the 49,152-wide head on every position.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kvshard.ranking import QUALITY_METRICS, best_index, quality
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, batched_isolated_scores, isolated_scores
from kvshard_training.block_attention import block_scores
from kvshard_training.examples import Example
from kvshard_training.frozen_bodies import FrozenBodies
from kvshard_training.model_teacher import zscore
from kvshard_training.settings import FinetuneSettings


def answer_logits(causal_lm: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits at the last position only, [batch, vocab], in float32: the decoder's last hidden
    state through ``lm_head`` (the head over every position would cost a 49,152-wide matmul per token).
    A bfloat16 base runs under autocast, so its float32 LoRA adapters meet bfloat16 activations."""
    return answer_and_label_logits(causal_lm, input_ids)[0]


def answer_and_label_logits(causal_lm: Any, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                            readout_token: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`answer_logits`, and — given ``positions`` [batch, K] — the logit of token ``readout_token`` at
    each of those positions [batch, K] from the same forward pass (one row of ``lm_head``, not the head)."""
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=causal_lm.dtype == torch.bfloat16):
        hidden = causal_lm.model(input_ids=input_ids, use_cache=False).last_hidden_state
        logits: torch.Tensor = causal_lm.lm_head(hidden[:, -1])
        readout = None
        if positions is not None:
            at_labels = hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
            readout = (at_labels @ causal_lm.lm_head.weight[readout_token].to(at_labels.dtype)).float()
    return logits.float(), readout


def label_loss(logits: torch.Tensor, label_ids: torch.Tensor, targets: torch.Tensor,
               soft: torch.Tensor | None = None, soft_weight: float = 0.0,
               positives: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy over the candidates' label tokens only: ``logits`` [B, V] at the answer position,
    ``label_ids`` [B, K] (or [K] for all rows), ``targets`` [B] indices into the K labels. With a
    teacher's ``soft`` [B, K] distribution, the target is ``(1 - soft_weight) · one-hot + soft_weight · soft``
    (``positives`` [B, K] in place of the one-hot: :func:`mixed_cross_entropy`)."""
    if label_ids.dim() == 1:
        label_ids = label_ids.expand(logits.shape[0], -1)
    return mixed_cross_entropy(logits.gather(-1, label_ids), targets, soft, soft_weight, positives)


def mixed_cross_entropy(scores: torch.Tensor, targets: torch.Tensor, soft: torch.Tensor | None = None,
                        soft_weight: float = 0.0, positives: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of ``scores`` [B, K] against ``(1 - soft_weight) · hard + soft_weight · soft``, where
    ``hard`` is ``one-hot(targets)``, or ``positives`` [B, K] when given (the target spread over several
    positives: ``--positives``).

    The pointwise term uses it too: there ``scores`` are one readout logit at each candidate's own label
    token (:func:`answer_and_label_logits`), asked to rank the candidates as the answer is. Each score is
    computed where its item has just been read, before the candidates that follow, so it is a per-item
    relevance — K graded signals per forward pass where the answer gives one."""
    hard = positives
    if soft is None or soft_weight == 0.0:
        return F.cross_entropy(scores, targets if hard is None else hard)
    if hard is None:
        hard = F.one_hot(targets, scores.shape[-1]).to(soft.dtype)
    return F.cross_entropy(scores, (1 - soft_weight) * hard + soft_weight * soft)


def order_disagreement(logits: torch.Tensor, label_ids: torch.Tensor, alignment: torch.Tensor) -> torch.Tensor:
    """Symmetric KL between the candidate distributions of two orders of one request, candidate by
    candidate: ``logits`` [2, V] at the answer position, ``label_ids`` [K], ``alignment`` [2, K] (see
    :class:`Example`). Zero exactly when the model ranks the items the same whatever their letters and
    places — the position consistency the cross-entropy alone only reaches through the data (R-Drop's
    agreement term, with the candidate order as the perturbation)."""
    label_logp = F.log_softmax(logits.gather(-1, label_ids.expand(logits.shape[0], -1)), dim=-1)
    first, second = label_logp.gather(-1, alignment)[:2]
    return 0.5 * (F.kl_div(first, second, log_target=True, reduction="sum")
                  + F.kl_div(second, first, log_target=True, reduction="sum"))


def example_loss(causal_lm: Any, example: Example, settings: FinetuneSettings, readout: int,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """One training example's loss under ``settings``: the isolated scores' cross-entropy, or the answer's
    label loss plus the optional pointwise and order-agreement terms."""
    if example.isolated:
        return isolated_loss(order_scores(causal_lm, example, readout), example, settings, scale)
    logits, scores = answer_and_label_logits(causal_lm, example.input_ids,
                                             example.label_positions if settings.pointwise > 0 else None, readout)
    loss = label_loss(logits, example.label_ids, example.targets, example.soft, settings.teacher_weight,
                      example.positives)
    if scores is not None:
        loss = loss + settings.pointwise * mixed_cross_entropy(scores, example.targets, example.soft,
                                                               settings.teacher_weight, example.positives)
    if example.orders > 1:
        loss = loss + settings.consistency * order_disagreement(logits, example.label_ids, example.alignment)
    return loss


def isolated_loss(scores: torch.Tensor, example: Example, settings: FinetuneSettings,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """An isolated or late example's loss from its orders' scores [P, K]: the mixed cross-entropy — of the
    served fusion ``scale · (z(scores) + stage)`` when the example carries the stage's part (``--retrieval-weight``)."""
    if example.stage is not None:
        if scale is None:
            raise ValueError("an example with the retrieval stage's scores needs the fusion's learned scale")
        scores = scale * served_scores(scores, example.stage)
    return mixed_cross_entropy(scores, example.targets, example.soft, settings.teacher_weight, example.positives)


def served_scores(scores: torch.Tensor, stage: torch.Tensor | None) -> torch.Tensor:
    """The ranking as served: ``scores`` [P, K] alone, or ``z(scores) + stage`` where ``stage`` holds the
    retrieval stage's ``W · z(score)`` [P, K] — :func:`kvshard.ranking.fuse_scores` in torch, differentiable."""
    return scores if stage is None else zscore(scores) + stage


def batch_losses(causal_lm: Any, examples: Sequence[Example], settings: FinetuneSettings,
                 readout: int, scale: torch.Tensor | None = None,
                 bodies: FrozenBodies | None = None) -> list[torch.Tensor]:
    """Each example's :func:`example_loss`. Isolated or late examples are scored together, in one forward
    pass (:func:`training_scores`); an answer-position example takes its own path, one at a time.
    ``scale``: the learned temperature of the served fusion (``--retrieval-weight``); ``bodies``: the late
    scorer's item bodies through the frozen layers (``--body-cache-mib``)."""
    if not all(e.isolated for e in examples):
        if len(examples) == 1:
            return [example_loss(causal_lm, examples[0], settings, readout, scale)]
        raise ValueError("only isolated or late examples are scored in batches (--batch needs --scorer isolated "
                         "or late)")
    scores = training_scores(causal_lm, [inputs for e in examples for inputs in e.isolated], readout, bodies)
    losses, start = [], 0
    for example in examples:
        losses.append(isolated_loss(torch.stack(scores[start:start + example.orders]), example, settings, scale))
        start += example.orders
    return losses


def training_scores(causal_lm: Any, prompts: Sequence[IsolatedInputs], readout: int,
                    bodies: FrozenBodies | None = None) -> list[torch.Tensor]:
    """The isolated or late scores of ``prompts`` in one training forward pass: on the CPU with the block
    attention (:func:`~kvshard_training.block_attention.block_scores`), given ``bodies`` through their cache
    (:mod:`kvshard_training.frozen_bodies`), elsewhere with the dense block mask (:func:`batched_isolated_scores`)."""
    if causal_lm.device.type == "cpu":
        return bodies.scores(prompts, readout) if bodies is not None else block_scores(causal_lm, prompts, readout)
    return batched_isolated_scores(causal_lm, prompts, readout)


def order_scores(causal_lm: Any, example: Example, readout: int) -> torch.Tensor:
    """Each order's K candidate scores [P, K] as the model ranks: the label logits at the answer position,
    or — for an example built with ``isolated`` — each candidate's isolated log P(readout)."""
    if example.isolated:
        return torch.stack([isolated_scores(causal_lm, inputs, readout) for inputs in example.isolated])
    return answer_logits(causal_lm, example.input_ids)[:, example.label_ids]


@torch.inference_mode()
def evaluate(causal_lm: Any, examples: Sequence[Example], readout: int = 0,
             first_order: list[list[float]] | None = None) -> dict[str, float]:
    """Mean label-restricted loss, HR@1/HR@5/NDCG@10 (averaged over each example's candidate orders; of the
    served fusion for examples with the stage's scores, and then ``alone_*`` of the model's own ranking),
    the most chosen label's share and — for examples with several orders — ``position_consistency``,
    the share whose chosen item is the same under every order (the recommender bench's measure).
    ``first_order``, when given, receives each example's model scores in its first order (for
    :func:`kvshard.ranking.choose_fusion_weight`)."""
    totals = dict.fromkeys(QUALITY_METRICS, 0.0)
    alone = dict.fromkeys(QUALITY_METRICS, 0.0)
    loss = 0.0
    chosen: Counter[int] = Counter()
    consistent = compared = answers = fused = 0
    for example in examples:
        model_scores = order_scores(causal_lm, example, readout)
        if first_order is not None:
            first_order.append(model_scores[0].float().tolist())
        all_scores = served_scores(model_scores, example.stage)
        loss += float(F.cross_entropy(all_scores, example.targets)) * example.orders
        items = set()
        for order in range(example.orders):
            if example.stage is not None:
                fused += 1
                for name, value in quality(model_scores[order].tolist(), int(example.targets[order])).items():
                    alone[name] += value
            scores = all_scores[order].tolist()
            best = best_index(scores)
            chosen[best] += 1
            items.add(int((example.alignment[order] == best).nonzero()[0, 0]))
            for name, value in quality(scores, int(example.targets[order])).items():
                totals[name] += value
        answers += example.orders
        if example.orders > 1:
            compared += 1
            consistent += len(items) == 1
    n = max(1, answers)
    result = {name: value / n for name, value in totals.items()}
    result["loss"] = loss / n
    result["max_label_share"] = max(chosen.values()) / n if chosen else 0.0
    if compared:
        result["position_consistency"] = consistent / compared
    if fused:
        result |= {f"alone_{name}": value / fused for name, value in alone.items()}
    result["prompts"] = float(len(examples))
    return result
