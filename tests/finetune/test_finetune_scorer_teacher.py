"""A trained scorer as the fine-tuning teacher (``--teacher-model``): its targets are its own order-free scores,
mixed with item-kNN's in z-score space, and a run with it records which scorer taught it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvshard.settings import SettingsError
from kvshard_training.model_teacher import mixed_distribution, zscore
from kvshard_training.settings import FinetuneSettings, cpu_has_bfloat16
from kvshard_training.teacher import soft_distribution


def test_the_mix_is_the_softmax_of_both_teachers_z_scores() -> None:
    knn_scores = [3.0, 1.0, 0.0, 0.5]
    scorer = torch.tensor([[-2.0, -9.0, -1.0, -4.0]])
    knn = torch.tensor([soft_distribution(knn_scores, 0.5)])
    mixed = mixed_distribution(knn, scorer, weight=2.0, temperature=0.5)
    expected = torch.softmax((zscore(torch.tensor([knn_scores])) + 2.0 * zscore(scorer)) / 0.5, dim=-1)
    assert torch.allclose(mixed, expected, atol=1e-6)
    assert torch.allclose(mixed_distribution(None, scorer, 1.0, 1.0), torch.softmax(zscore(scorer), dim=-1))


def test_a_constant_scorer_leaves_item_knn_alone() -> None:
    knn = torch.tensor([soft_distribution([3.0, 1.0, 0.0], 1.0)])
    assert torch.allclose(mixed_distribution(knn, torch.full((1, 3), -5.0), 1.0, 1.0), knn, atol=1e-6)


def test_a_scorer_teacher_is_refused_for_the_answer_position() -> None:
    FinetuneSettings(scorer="late", teacher_model=Path("scorer")).validate()
    with pytest.raises(SettingsError, match="--teacher-model needs --scorer"):
        FinetuneSettings(teacher_model=Path("scorer")).validate()
    with pytest.raises(SettingsError, match="--teacher-model needs --scorer"):
        FinetuneSettings(scorer="late", teacher_model=Path("scorer"), teacher_model_weight=0.0).validate()


def test_the_hard_negative_share_is_a_share() -> None:
    FinetuneSettings(hard_negatives=1.0).validate()
    with pytest.raises(SettingsError, match="--hard-negatives"):
        FinetuneSettings(hard_negatives=1.5).validate()


@pytest.mark.model
def test_the_targets_are_the_teachers_own_scores_under_every_order() -> None:
    from transformers import AutoTokenizer

    from kvshard.datasets import load_dataset
    from kvshard.models import model_template, resolve_model
    from kvshard.prompts import PromptBuilder, RecommendationRequest
    from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, isolated_scores
    from kvshard_training.examples import Example
    from kvshard_training.finetune import taught
    from kvshard_training.model_teacher import ScorerTeacher

    teacher = ScorerTeacher("scorer")
    builder = PromptBuilder(AutoTokenizer.from_pretrained(teacher.folder), load_dataset("movielens-100k"),
                            template=model_template(resolve_model("scorer")))
    first = RecommendationRequest("1", ("1", "2", "3"), ("10", "20", "30", "40"), target="20")
    second = RecommendationRequest("1", ("1", "2", "3"), ("40", "30", "10", "20"), target="20")
    orders = (builder.build(first), builder.build(second))
    example = Example.of(*orders, isolated=True, interaction=4)

    scores = teacher.scores(example.isolated, example.alignment)
    with torch.inference_mode():
        direct = [isolated_scores(teacher.model, IsolatedInputs.of(o).ending_at_openings(), teacher.readout)
                  for o in orders]
    # the teacher's own scores (every item token reading the prefix), computed once and carried to each order:
    # exactly the first order's, and the second order's up to bfloat16 rounding (its items sit elsewhere)
    assert torch.equal(scores[0], direct[0])
    assert torch.allclose(scores[1], direct[1], atol=0.25)
    assert scores[1].argmax() == direct[1].argmax()
    settings = FinetuneSettings(scorer="late", interaction=4, teacher="none", teacher_model=Path("scorer"),
                                teacher_temperature=1.0)
    soft = taught(example, teacher, settings).soft
    assert soft is not None
    assert torch.allclose(soft[0], torch.softmax(zscore(direct[0]), dim=-1), atol=1e-5)
    # the same item gets the same probability in both orders (alignment: where order 1 puts order 0's items)
    assert torch.allclose(soft[1][example.alignment[1]], soft[0], atol=1e-5)


@pytest.mark.model
def test_a_base_model_is_not_a_scorer_teacher() -> None:
    from kvshard_training.model_teacher import ScorerTeacher

    with pytest.raises(ValueError, match="is not a scorer"):
        ScorerTeacher("base")


@pytest.mark.model
def test_two_steps_with_the_isolated_scorer_teaching_a_late_student_on_stage_negatives_and_later_targets(
        tmp_path: Path) -> None:
    from kvshard.cli import main

    settings = FinetuneSettings(out=tmp_path, history=3, candidates=4, steps=2, accumulation=1, users=5,
                                val_users=2, rank=2, alpha=4, layers=2, targets=("q_proj", "v_proj"), warmup=1,
                                minutes=5.0, scorer="late", interaction=4, teacher_model=Path("scorer"),
                                hard_negatives=0.5, positives=2)
    assert main(settings.command().split()[1:]) == 0
    provenance = json.loads((tmp_path / "provenance.json").read_text())
    assert provenance["teacher"]["kind"] == "item-knn"
    assert provenance["teacher"]["scorer"]["model"] == "SmolLM2-135M-MovieLens-Scorer"
    assert provenance["teacher"]["scorer"]["scorer"] == "isolated"
    assert provenance["settings"]["teacher_model"] == "scorer"
    assert provenance["split"]["hard_negatives"]["share"] == 0.5
    assert provenance["split"]["hard_negatives"]["stage"].startswith("item-kNN")
    assert provenance["split"]["positives"]["next_items"] == 2
    assert 1.0 < provenance["split"]["positives"]["mean_per_prompt"] <= 2.0
    assert provenance["steps"] == 2
    assert provenance["settings"]["precision"] == ("bfloat16" if cpu_has_bfloat16() else "float32")  # 'auto' resolved
