"""Training the ranking as it is served behind a retrieval stage (``--retrieval-weight``): the loss reads
``z(model) + W · z(stage score)``, the stage's score on a training prompt is the one a stage that never
counted the prompt's user would give, and validation reports the fused ranking beside the model alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvshard.prompts import RecommendationRequest
from kvshard.ranking import fuse_scores
from kvshard.retrieval import RetrievalIndex
from kvshard.settings import SettingsError
from kvshard_training.examples import stage_terms
from kvshard_training.losses import served_scores
from kvshard_training.settings import FinetuneSettings
from kvshard_training.teacher import ItemKnnTeacher

HISTORIES = {"u1": ["a", "b", "c", "d", "x", "y"], "u2": ["a", "c", "e", "f", "x", "y"],
             "u3": ["b", "c", "e", "g", "x", "y"], "u4": ["a", "b", "f", "g", "x", "y"]}


def test_the_trained_ranking_is_the_served_fusion() -> None:
    model = torch.tensor([[-3.0, -1.0, -2.5, -0.5], [0.2, 0.1, 0.4, 0.3]])
    stage = [[1.0, 0.0, 4.0, 2.0], [3.0, 3.0, 0.0, 1.0]]
    weight = 0.7
    terms = torch.tensor([[weight * z for z in _z(row)] for row in stage])
    fused = served_scores(model, terms)
    for row in range(2):
        expected = fuse_scores(model[row].tolist(), stage[row], weight)
        assert fused[row].tolist() == pytest.approx(expected, abs=1e-5)
    assert served_scores(model, None) is model, "without the stage the model ranks alone"


def test_a_constant_model_leaves_the_stage_order_and_the_gradient_reaches_the_model() -> None:
    model = torch.full((1, 3), -2.0, requires_grad=True)
    fused = served_scores(model, torch.tensor([[1.0, -1.0, 0.0]]))
    assert fused.tolist() == [[1.0, -1.0, 0.0]]
    moving = torch.tensor([[-2.0, -1.0, -3.0]], requires_grad=True)
    torch.nn.functional.cross_entropy(served_scores(moving, torch.zeros(1, 3)), torch.tensor([2])).backward()
    assert moving.grad is not None and moving.grad[0, 2] < 0, "the loss raises the target's model score"


def test_the_stage_score_of_a_training_prompt_is_a_stage_that_never_counted_its_user() -> None:
    teacher = ItemKnnTeacher(HISTORIES, HISTORIES)
    request = RecommendationRequest("u1", ("a", "b", "c"), ("d", "e", "f", "g"), target="d")
    others = RetrievalIndex({u: items[:-2] for u, items in HISTORIES.items() if u != "u1"})
    expected = others.scores(request.history, request.candidates)
    assert teacher.stage_scores(request.history, request.candidates, "u1") == pytest.approx(expected)
    assert teacher.stage_scores(request.history, request.candidates) != pytest.approx(expected), \
        "the user's own history would vouch for its own target"
    terms = stage_terms(teacher, [request], 2.0)
    assert terms is not None and terms[0] == pytest.approx([2.0 * z for z in _z(expected)])
    assert stage_terms(teacher, [request], 0.0) is None


def test_the_retrieval_weight_needs_a_per_candidate_scorer() -> None:
    FinetuneSettings(scorer="late", retrieval_weight=1.0).validate()
    for bad in (FinetuneSettings(retrieval_weight=1.0), FinetuneSettings(scorer="late", retrieval_weight=-1.0)):
        with pytest.raises(SettingsError, match="--retrieval-weight"):
            bad.validate()


@pytest.mark.model
def test_two_steps_trained_as_served_record_the_fusion_and_validate_both_rankings(tmp_path: Path) -> None:
    from kvshard.cli import main

    settings = FinetuneSettings(out=tmp_path, history=3, candidates=4, steps=2, accumulation=1, users=5,
                                val_users=2, rank=2, alpha=4, layers=2, targets=("q_proj", "v_proj"), warmup=1,
                                minutes=5.0, scorer="late", interaction=4, retrieval_weight=1.0, teacher="none")
    assert main(settings.command().split()[1:]) == 0
    provenance = json.loads((tmp_path / "provenance.json").read_text())
    fusion = provenance["split"]["retrieval_fusion"]
    assert fusion["weight"] == 1.0 and fusion["learned_scale"] > 0
    validation = provenance["evaluation"]["validation"]
    assert {"hr1", "ndcg10", "alone_hr1", "alone_ndcg10"} <= set(validation)


def _z(values: list[float]) -> list[float]:
    mean = sum(values) / len(values)
    spread = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
    return [(v - mean) / spread for v in values]
