"""Rankings over candidates: the answer a recommender returns, and how it is scored."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvshard.ranking import (
    FUSION_WEIGHTS,
    best_index,
    choose_fusion_weight,
    fuse_scores,
    kendall_tau,
    label_logprobs,
    likelihood_fusion_weight,
    quality,
    random_quality,
    rank_candidates,
    rank_of,
    standardized,
)

scores_lists = st.lists(st.floats(-30, 30, allow_nan=False), min_size=1, max_size=40)


@given(scores_lists)
def test_a_ranking_holds_every_candidate_once_best_first_as_a_distribution(scores: list[float]) -> None:
    candidates = [f"item-{i}" for i in range(len(scores))]
    labels = [chr(ord("A") + i) if i < 26 else f"L{i}" for i in range(len(scores))]
    ranking = rank_candidates(candidates, labels, scores)
    assert sorted(r.candidate for r in ranking) == sorted(candidates)
    assert all(labels[candidates.index(r.candidate)] == r.label for r in ranking)
    logprobs = [r.logprob for r in ranking]
    assert logprobs == sorted(logprobs, reverse=True)
    assert math.isclose(math.fsum(math.exp(lp) for lp in logprobs), 1.0, rel_tol=1e-9)
    assert ranking[0].candidate == candidates[best_index(scores)]


@given(scores_lists, st.floats(-1e3, 1e3, allow_nan=False))
def test_logits_and_full_vocabulary_logprobs_give_the_same_ranking(scores: list[float], shift: float) -> None:
    """The embedded engine hands logits, vLLM full-vocabulary log-probabilities: a constant apart."""
    shifted = [s + shift for s in scores]
    for a, b in zip(label_logprobs(scores), label_logprobs(shifted), strict=True):
        assert math.isclose(a, b, abs_tol=1e-6)


def test_ties_keep_the_prompt_order() -> None:
    ranking = rank_candidates(["x", "y", "z"], ["A", "B", "C"], [1.0, 2.0, 2.0])
    assert [r.candidate for r in ranking] == ["y", "z", "x"]
    assert best_index([1.0, 2.0, 2.0]) == 1 and rank_of([1.0, 2.0, 2.0], 2) == 1


def test_a_label_with_no_probability_ranks_last() -> None:
    ranking = rank_candidates(["x", "y"], ["A", "B"], [-math.inf, 0.0])
    assert [(r.candidate, r.logprob) for r in ranking] == [("y", 0.0), ("x", -math.inf)]
    with pytest.raises(ValueError, match="-inf"):
        label_logprobs([-math.inf, -math.inf])


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="as many"):
        rank_candidates(["x", "y"], ["A"], [0.0, 1.0])


def test_quality_reads_the_rank_of_the_held_out_item() -> None:
    scores = [0.1, 0.9, 0.5, 0.3, 0.2, 0.8, 0.0]  # target index 3 is 4th best (rank 3)
    assert quality(scores, 1) == {"hr1": 1.0, "hr5": 1.0, "ndcg10": 1.0}
    assert quality(scores, 3) == {"hr1": 0.0, "hr5": 1.0, "ndcg10": 1 / math.log2(5)}
    assert quality(scores, 6)["hr5"] == 0.0 and quality(scores, 6)["ndcg10"] == 1 / math.log2(8)


@pytest.mark.parametrize("count", [2, 5, 12, 20])
def test_the_random_expectation_is_the_mean_over_every_target_position(count: int) -> None:
    scores = [float(count - i) for i in range(count)]  # a fixed ranking; the target is uniform
    by_position = [quality(scores, target) for target in range(count)]
    expected = random_quality(count)
    for metric, value in expected.items():
        assert math.isclose(value, statistics.mean(q[metric] for q in by_position))
    assert random_quality(20)["hr1"] == 0.05 and random_quality(20)["hr5"] == 0.25


def test_kendall_tau_is_one_for_the_same_order_and_minus_one_reversed() -> None:
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert kendall_tau([1, 1], [2, 2]) == 1.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    assert -1.0 <= kendall_tau([1, 1, 2], [1, 2, 2]) <= 1.0


@given(st.lists(st.floats(-50, 50), min_size=2, max_size=20), st.floats(0.1, 1e3), st.floats(-1e3, 1e3))
def test_fusion_is_free_of_either_scores_scale(scores: list[float], scale: float, shift: float) -> None:
    assume(statistics.pstdev(scores) > 1e-3)  # equal scores carry no order; rounding would invent one
    stage = [float(i % 3) for i in range(len(scores))]
    fused = fuse_scores(scores, stage)
    rescaled = fuse_scores([s * scale + shift for s in scores], [s * 7 - 2 for s in stage])
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(fused, rescaled, strict=True))


def test_fusion_sums_the_z_scores_with_the_stages_weight() -> None:
    assert fuse_scores([1.0, 2.0, 3.0], [0.0, 0.0, 0.0]) == pytest.approx([-1.2247449, 0.0, 1.2247449])
    assert fuse_scores([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx([0.0, 0.0, 0.0])
    assert fuse_scores([1.0, 2.0, 3.0], [30.0, 20.0, 10.0], weight=2.0) == pytest.approx([1.2247449, 0.0, -1.2247449])
    assert fuse_scores([-math.inf, 0.0, 1.0], [1.0, 0.0, 0.0])[0] == -math.inf  # no probability stays last
    ranking = rank_candidates(["a", "b", "c"], ["A", "B", "C"], [1.0, 2.0, 3.0], fuse_scores([1.0, 2.0, 3.0],
                                                                                          [9.0, 0.0, 0.0], 2.0))
    assert [r.candidate for r in ranking] == ["a", "c", "b"] and ranking[0].logprob < ranking[1].logprob
    assert ranking[0].as_json()["fused_score"] == pytest.approx(ranking[0].fused)
    with pytest.raises(ValueError, match="as many"):
        fuse_scores([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="finite"):
        fuse_scores([1.0, 2.0], [1.0, math.nan])


def test_the_fusion_weight_is_the_one_under_which_the_targets_are_likeliest() -> None:
    # 1,500 prompts whose target is drawn from softmax(1.5 · z(model) + 3 · z(stage)): the fit finds W = 2
    rng = random.Random(7)
    model = [[rng.gauss(0, 1) for _ in range(10)] for _ in range(1500)]
    stage = [[rng.gauss(0, 1) for _ in range(10)] for _ in range(1500)]
    targets = []
    for m, s in zip(model, stage, strict=True):
        logits = [1.5 * a + 3.0 * b for a, b in zip(standardized(m), standardized(s), strict=True)]
        targets.append(rng.choices(range(10), weights=[math.exp(v) for v in logits])[0])
    assert abs(likelihood_fusion_weight(model, stage, targets) - 2.0) <= 0.4
    # choose_fusion_weight serves that fit, and reports it beside the grid
    choice = choose_fusion_weight(model[:200], stage[:200], targets[:200])
    assert choice.weight == likelihood_fusion_weight(model[:200], stage[:200], targets[:200])
    assert set(FUSION_WEIGHTS) <= set(choice.by_weight) and choice.weight in choice.by_weight
    assert choice.as_json()["retrieval_weight"] == choice.weight and choice.as_json()["prompts"] == 200
    assert "log-likelihood" in str(choice.as_json()["chosen_by"])


def test_a_stage_that_knows_better_than_the_model_gets_the_largest_weight_and_one_that_does_not_none() -> None:
    # three prompts of four candidates, the target last: the stage ranks it first, the model last
    stage = [[1.0, 2.0, 3.0, 4.0]] * 3
    model = [[3.0, 2.0, 1.0, 0.0]] * 3
    choice = choose_fusion_weight(model, stage, [3, 3, 3])
    assert choice.weight == FUSION_WEIGHTS[-1] and choice.by_weight[choice.weight]["hr1"] == 1.0
    assert choice.by_weight[0.0]["hr1"] == 0.0 and choice.stage_alone["hr1"] == 1.0
    assert choose_fusion_weight(stage, model, [3, 3, 3]).weight == 0.0


def test_a_candidate_without_a_finite_score_is_left_out_of_the_fit() -> None:
    model = [[0.0, 1.0, -math.inf, 2.0], [-math.inf, 0.0, 1.0, 2.0]]
    stage = [[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]]
    assert 0.0 <= likelihood_fusion_weight(model, stage, [3, 0]) <= FUSION_WEIGHTS[-1]  # the 2nd prompt left out
    with pytest.raises(ValueError, match="finite"):
        likelihood_fusion_weight(model[1:], stage[1:], [0])


def test_the_fusion_weight_needs_one_score_list_and_target_per_prompt() -> None:
    with pytest.raises(ValueError, match="per prompt"):
        choose_fusion_weight([[1.0, 2.0]], [[1.0, 2.0]], [0, 1])
    with pytest.raises(ValueError, match="per prompt"):
        choose_fusion_weight([], [], [])
