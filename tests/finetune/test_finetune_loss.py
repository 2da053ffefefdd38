"""The fine-tuning loss covers the candidates' label tokens at the answer position, and nothing else."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvshard_training.finetune import lr_factor
from kvshard_training.losses import (
    answer_and_label_logits,
    answer_logits,
    label_loss,
    mixed_cross_entropy,
    order_disagreement,
)

VOCAB = 97
LABELS = torch.tensor([11, 3, 40, 7])


@pytest.fixture(scope="module")
def tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def test_loss_is_cross_entropy_over_the_label_slice() -> None:
    logits = torch.randn(3, VOCAB)
    targets = torch.tensor([0, 2, 3])
    expected = F.cross_entropy(logits[:, LABELS], targets)
    assert torch.allclose(label_loss(logits, LABELS, targets), expected)


def test_perturbing_non_label_logits_leaves_the_loss_unchanged() -> None:
    logits = torch.randn(2, VOCAB)
    targets = torch.tensor([1, 2])
    before = label_loss(logits, LABELS, targets)
    perturbed = logits + 50 * torch.randn_like(logits)
    perturbed[:, LABELS] = logits[:, LABELS]
    assert torch.equal(label_loss(perturbed, LABELS, targets), before)


def test_gradient_reaches_only_the_label_tokens() -> None:
    logits = torch.randn(2, VOCAB, requires_grad=True)
    label_loss(logits, torch.stack([LABELS, LABELS.flip(0)]), torch.tensor([0, 3])).backward()
    assert logits.grad is not None
    touched = set(logits.grad.abs().sum(0).nonzero().flatten().tolist())
    assert touched == set(LABELS.tolist())


def test_answer_logits_are_the_models_last_position_logits(tiny_llama: Any) -> None:
    ids = torch.randint(0, VOCAB, (1, 17))
    with torch.no_grad():
        expected = tiny_llama(input_ids=ids).logits[:, -1]
        got = answer_logits(tiny_llama, ids)
    assert got.shape == (1, VOCAB)
    assert torch.allclose(got, expected, atol=1e-5)
    target = torch.tensor([1])
    assert torch.allclose(label_loss(got, LABELS, target), label_loss(expected, LABELS, target), atol=1e-6)


def test_the_pointwise_readout_is_the_models_logit_at_each_label_position(tiny_llama: Any) -> None:
    ids = torch.randint(0, VOCAB, (2, 17))
    positions = torch.tensor([[3, 7, 11], [2, 9, 15]])
    with torch.no_grad():
        full = tiny_llama(input_ids=ids).logits
        answer, readout = answer_and_label_logits(tiny_llama, ids, positions, readout_token=5)
    assert readout is not None and readout.shape == (2, 3)
    assert torch.allclose(answer, full[:, -1], atol=1e-5)
    assert torch.allclose(readout, full[torch.arange(2).unsqueeze(1), positions, 5], atol=1e-5)


def test_the_pointwise_term_mixes_the_same_targets_as_the_answer() -> None:
    scores = torch.randn(2, 4)
    targets = torch.tensor([1, 3])
    soft = torch.softmax(torch.randn(2, 4), dim=-1)
    assert torch.allclose(mixed_cross_entropy(scores, targets), F.cross_entropy(scores, targets))
    logits = torch.randn(2, VOCAB)
    logits[:, LABELS] = scores
    mixed = mixed_cross_entropy(scores, targets, soft, 0.5)
    assert torch.allclose(mixed, label_loss(logits, LABELS, targets, soft, 0.5))
    teacher_only = -(soft * scores.log_softmax(-1)).sum(-1).mean()
    assert torch.allclose(mixed_cross_entropy(scores, targets, soft, 1.0), teacher_only)


def test_learning_rate_warms_up_then_decays_to_the_floor() -> None:
    factors = [lr_factor(step, warmup=5, total=50) for step in range(50)]
    assert factors[0] == pytest.approx(0.2) and factors[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:], strict=False))
    assert lr_factor(50, 5, 50) == pytest.approx(0.1)


def test_a_spent_time_budget_anneals_the_learning_rate_early() -> None:
    assert lr_factor(10, warmup=5, total=1000, time_used=1.0) == pytest.approx(0.1)
    assert lr_factor(10, warmup=5, total=1000, time_used=0.5) == pytest.approx(0.55)


# the second order puts order 0's candidates (at positions 0..3) at positions 2, 0, 3, 1
ALIGNMENT = torch.tensor([[0, 1, 2, 3], [2, 0, 3, 1]])


def _two_orders(item_scores: list[float], second: list[float] | None = None) -> torch.Tensor:
    """Answer logits of two orders that score order 0's items ``item_scores`` (and ``second`` in order 1)."""
    logits = torch.randn(2, VOCAB)
    logits[0, LABELS] = torch.tensor(item_scores)
    logits[1, LABELS[ALIGNMENT[1]]] = torch.tensor(second if second is not None else item_scores)
    return logits


def test_two_orders_that_rank_the_items_alike_do_not_disagree() -> None:
    logits = _two_orders([2.0, -1.0, 0.5, 0.0])
    assert float(order_disagreement(logits, LABELS, ALIGNMENT)) == pytest.approx(0.0, abs=1e-6)


def test_a_position_bias_is_a_disagreement_and_its_gradient_reaches_both_orders() -> None:
    # the model favours the first place whatever stands there: item 0 in order 0, item 1 in order 1
    logits = _two_orders([3.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0]).requires_grad_()
    disagreement = order_disagreement(logits, LABELS, ALIGNMENT)
    assert float(disagreement.detach()) > 1.0
    disagreement.backward()
    assert logits.grad is not None
    assert set(logits.grad.abs().sum(0).nonzero().flatten().tolist()) == set(LABELS.tolist())
    assert float(logits.grad[0].abs().sum()) > 0 and float(logits.grad[1].abs().sum()) > 0


def test_several_positives_share_the_hard_target_evenly() -> None:
    scores = torch.randn(2, 5)
    targets = torch.tensor([0, 3])
    positives = torch.tensor([[0.5, 0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0]])
    soft = torch.softmax(torch.randn(2, 5), -1)
    assert torch.allclose(mixed_cross_entropy(scores, targets, positives=positives),
                          F.cross_entropy(scores, positives))
    assert torch.allclose(mixed_cross_entropy(scores, targets, soft, 0.5, positives),
                          F.cross_entropy(scores, 0.5 * positives + 0.5 * soft))
    one_hot = F.one_hot(targets, 5).float()  # one positive: the one-hot of the target, as without them
    assert torch.allclose(mixed_cross_entropy(scores, targets, soft, 0.5, one_hot),
                          mixed_cross_entropy(scores, targets, soft, 0.5))
