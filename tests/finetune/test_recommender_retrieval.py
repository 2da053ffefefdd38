"""`kvshard bench recommender --candidate-set retrieval`: the retrieval stage's candidates, its recall and
its own order as the baseline a reranker must beat — the arithmetic on hand-made requests, the real run
on a few held-out MovieLens users with the base model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshard.cli import build_parser
from kvshard.prompts import RecommendationRequest
from kvshard.retrieval import RetrievedRequest
from kvshard_bench.recommender import baseline_quality, format_retrieval_table, retrieval_fields, run


def staged(target: str, order: tuple[str, ...]) -> RetrievedRequest:
    return RetrievedRequest(RecommendationRequest("u", ("h",), tuple(reversed(order)), target), order)


def test_uniform_negatives_stay_the_default() -> None:
    argv = ["bench", "recommender"]
    assert build_parser(argv).parse_args(argv).candidate_set == "uniform"
    argv = ["bench", "recommender", "--candidate-set", "retrieval"]
    assert build_parser(argv).parse_args(argv).candidate_set == "retrieval"


def test_the_stage_fields_are_its_recall_and_its_orders_quality_all_and_retrieved() -> None:
    # targets at the stage's ranks 0 and 1, two missed
    stage = [staged("a", ("a", "b")), staged("b", ("a", "b")), staged("c", ("a", "b")), staged("d", ("a", "b"))]
    fields = retrieval_fields(stage, candidates=2)
    assert fields["retrieval_recall"] == 0.5 and fields["retrieval_retrieved"] == 2
    assert fields["retrieval_order_hr1"] == 0.25 and fields["retrieval_order_retrieved_hr1"] == 0.5
    assert fields["retrieval_order_ndcg10"] == pytest.approx((1 + 1 / 1.5849625) / 4)
    # a random reranking of two candidates: HR@1 1/2 where retrieved, so 1/4 over all
    assert fields["random_retrieved_hr1"] == 0.5 and fields["random_hr1"] == 0.25


def test_a_model_free_ranking_scores_zero_where_the_target_was_not_retrieved() -> None:
    hit = RecommendationRequest("u1", ("h",), ("a", "b"), "a")
    missed = RecommendationRequest("u2", ("h",), ("a", "b"), "z")
    first_wins = baseline_quality([[hit], [missed]], lambda r: [1.0, 0.0])
    assert first_wins["hr1"] == 0.5 and first_wins["ndcg10"] == 0.5


def test_the_retrieval_table_puts_each_model_beside_the_retrieval_order() -> None:
    stage = [staged("a", ("a", "b")), staged("c", ("a", "b"))]
    fields = retrieval_fields(stage, candidates=2)
    row = {"model": "late", "ndcg10": 0.4, "hr1": 0.3, "retrieved_ndcg10": 0.8, "retrieved_hr1": 0.6}
    table = format_retrieval_table([row], fields)
    assert "recall@K 0.500 (1 targets retrieved)" in table
    assert "late" in table and "retrieval order (the stage's own)" in table and "0.800" in table


def test_retrieval_candidates_refuse_training_users() -> None:
    argv = ["bench", "recommender", "--candidate-set", "retrieval", "--all-users", "--models", "base"]
    with pytest.raises(SystemExit, match="held-out users only"):
        run(build_parser(argv).parse_args(argv))


@pytest.mark.model
def test_a_tiny_retrieval_run_reports_the_stage_beside_the_model(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.json"
    argv = ["bench", "recommender", "--models", "base", "--users", "6", "--history", "5", "--candidates", "10",
            "--permutations", "1", "--candidate-set", "retrieval", "--no-fuse-retrieval", "--json", str(out)]
    rows = run(build_parser(argv).parse_args(argv))
    assert json.loads(out.read_text()) == rows and len(rows) == 1
    row = rows[0]
    assert row["candidate_set"] == "retrieval" and row["users"] == 6
    assert row["retrieval_retrieved"] == round(row["retrieval_recall"] * 6)
    for field in ("hr1", "ndcg10", "position_consistency", "retrieved_hr1", "retrieved_ndcg10",
                  "retrieval_order_ndcg10", "retrieval_order_retrieved_hr1", "popularity_hr1", "item_knn_ndcg10"):
        assert 0.0 <= row[field] <= 1.0
    assert row["hr1"] <= row["retrieval_recall"] and row["retrieval_order_hr1"] <= row["retrieval_recall"]
    assert "retrieval-stage candidates: recall@K" in capsys.readouterr().out
