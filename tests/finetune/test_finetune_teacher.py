"""The item-kNN teacher: soft targets from training users' co-occurrence, never from what is held out."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvshard_training.losses import label_loss
from kvshard_training.teacher import ItemKnnTeacher, soft_distribution, teacher_quality

# Each history ends with the validation target and the last item, which the teacher must not see.
HISTORIES = {
    "u1": ["a", "b", "c", "VAL1", "LAST1"],
    "u2": ["a", "b", "d", "VAL2", "LAST2"],
    "u3": ["a", "c", "e", "VAL3", "LAST3"],
    "held": ["a", "z", "q", "r", "s"],
}
TRAINING = ["u1", "u2", "u3"]


def test_co_occurring_candidates_score_above_unrelated_ones() -> None:
    teacher = ItemKnnTeacher(HISTORIES, TRAINING)
    scores = teacher.scores(["a"], ["b", "e", "never-seen"])
    assert scores[0] > scores[1] > scores[2]
    assert teacher.similarity("b", "b") == pytest.approx(1.0)


def test_validation_targets_last_items_and_held_out_users_are_invisible() -> None:
    teacher = ItemKnnTeacher(HISTORIES, TRAINING)
    for item in ("VAL1", "LAST1", "VAL2", "z", "q"):
        assert teacher.similarity("a", item) == 0.0


def test_leaving_a_user_out_removes_their_vote_for_their_own_target() -> None:
    teacher = ItemKnnTeacher(HISTORIES, TRAINING)
    assert teacher.similarity("c", "e") > 0  # only u3 has both
    assert teacher.similarity("c", "e", without="u3") == 0.0
    assert teacher.similarity("a", "b", without="u3") == pytest.approx(1.0)  # u1, u2 have both; u3 had only a


def test_soft_distribution_is_a_temperature_softmax_of_z_scores() -> None:
    sharp, flat = soft_distribution([3.0, 1.0, 0.0], 0.5), soft_distribution([3.0, 1.0, 0.0], 5.0)
    assert math.isclose(sum(sharp), 1.0) and math.isclose(sum(flat), 1.0)
    assert sharp[0] > flat[0] > flat[1] > flat[2]
    assert soft_distribution([30.0, 10.0, 0.0], 1.0) == pytest.approx(soft_distribution([3.0, 1.0, 0.0], 1.0))
    assert soft_distribution([2.0, 2.0], 1.0) == [0.5, 0.5]
    with pytest.raises(ValueError):
        soft_distribution([1.0], 0.0)


def test_teacher_quality_scores_its_own_ranking() -> None:
    teacher = ItemKnnTeacher(HISTORIES, TRAINING)
    result = teacher_quality(teacher, [("x", ["a"], ["e", "b"], 1), ("x", ["a"], ["b", "never-seen"], 0)])
    assert result["hr1"] == 1.0


def test_soft_targets_mix_into_the_label_cross_entropy() -> None:
    logits = torch.randn(2, 50)
    labels = torch.tensor([4, 9, 17])
    targets = torch.tensor([0, 2])
    soft = torch.tensor([[0.2, 0.5, 0.3], [0.1, 0.1, 0.8]])
    assert torch.equal(label_loss(logits, labels, targets, soft, 0.0), label_loss(logits, labels, targets))
    mixed = 0.25 * F.one_hot(targets, 3).float() + 0.75 * soft
    expected = F.cross_entropy(logits[:, labels], mixed)
    assert torch.allclose(label_loss(logits, labels, targets, soft, 0.75), expected)
