"""`kvshard bench recommender`: quality beside random, position consistency and label share, per model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshard.cli import build_parser
from kvshard.prompts import RecommendationRequest
from kvshard_bench.paired import paired_difference
from kvshard_bench.recommender import (
    bootstrap_ci,
    item_knn_quality,
    meets_targets,
    permutations,
    popularity_quality,
    resolve_model,
    run,
    summarize,
)

PERFECT = {"hr1": 1.0, "hr5": 1.0, "ndcg10": 1.0}
MISS = {"hr1": 0.0, "hr5": 1.0, "ndcg10": 0.5}


def test_a_position_biased_model_is_inconsistent_and_all_one_letter() -> None:
    # Both users: the model answers "A" whatever item sits there.
    choices = [[("i1", "A"), ("i2", "A"), ("i3", "A")], [("i4", "A"), ("i5", "A"), ("i6", "A")]]
    row = summarize(choices, [[PERFECT, MISS, MISS], [MISS, MISS, MISS]], seed=0)
    assert row["position_consistency"] == 0.0
    assert row["max_label_share"] == 1.0 and row["max_label"] == "A"
    assert row["hr1"] == pytest.approx(1 / 6)
    assert not meets_targets(row)


def test_an_item_driven_model_is_consistent_across_orders() -> None:
    choices = [[("i1", "A"), ("i1", "C"), ("i1", "B")], [("i4", "D"), ("i4", "B"), ("i9", "C")],
               [("i7", "E"), ("i7", "F"), ("i7", "G")], [("i2", "H"), ("i2", "I"), ("i2", "J")]]
    row = summarize(choices, [[PERFECT] * 3] * 4, seed=0)
    assert row["position_consistency"] == 0.75
    assert row["max_label_share"] == pytest.approx(2 / 12)
    assert row["hr1"] == 1.0 and row["hr1_ci"] == [1.0, 1.0]


def test_permutations_reorder_the_same_candidates_deterministically() -> None:
    request = RecommendationRequest("u", ("h",), tuple(f"c{i}" for i in range(20)), "c3")
    orders = permutations([request], 3, seed=5)[0]
    assert orders[0] == request and len(orders) == 3
    assert all(sorted(o.candidates) == sorted(request.candidates) and o.target == "c3" for o in orders)
    assert len({o.candidates for o in orders}) == 3
    assert permutations([request], 3, seed=5)[0] == orders


def test_the_popularity_baseline_ranks_by_rating_count_without_counting_the_targets() -> None:
    from kvshard.datasets import Dataset, Item

    items = {i: Item(i, i) for i in ("hit", "popular", "x", "h")}
    histories = {"u1": ["h", "hit"], "u2": ["hit", "popular"], "u3": ["hit", "popular"], "u4": ["hit"],
                 "u5": ["h", "x"], "u6": ["x"], "u7": ["x"]}
    dataset = Dataset("toy", items, histories)
    # "hit": 4 ratings, one of them u1's target → 3, above "popular"'s 2
    first = RecommendationRequest("u1", ("h",), ("popular", "hit", "x"), "hit")
    assert popularity_quality(dataset, [[first]]) == {"hr1": 1.0, "hr5": 1.0, "ndcg10": 1.0}
    # "x": 3 ratings, one of them u5's target → 2, a tie with "popular", which stands first; counted with
    # the target's own rating it would have won
    behind = RecommendationRequest("u5", ("h",), ("popular", "x"), "x")
    ahead = RecommendationRequest("u5", ("h",), ("x", "popular"), "x")
    assert popularity_quality(dataset, [[behind]])["hr1"] == 0.0
    assert popularity_quality(dataset, [[behind, ahead]])["hr1"] == 0.5  # one user, mean over the orders


def test_the_item_knn_baseline_ranks_by_co_occurrence_with_the_history_not_popularity() -> None:
    from kvshard.datasets import Dataset, Item
    from kvshard.splits import UserSplit

    items = {i: Item(i, i) for i in ("h", "paired", "popular", "x", "y")}
    # training users' interactions before their last two count: "paired" co-occurs with "h" twice,
    # "popular" is rated by three users who never rated "h"
    histories = {"u2": ["h", "paired", "x", "y"], "u3": ["h", "paired", "x", "y"],
                 "u4": ["popular", "x", "x", "y"], "u5": ["popular", "y", "x", "y"], "u6": ["popular", "x", "x", "y"],
                 "u1": ["h", "paired"]}
    dataset = Dataset("toy", items, histories)
    everyone_trains = UserSplit(0.0, "salt")
    request = RecommendationRequest("u1", ("h",), ("popular", "paired"), "paired")
    assert item_knn_quality(dataset, everyone_trains, [[request]])["hr1"] == 1.0
    assert popularity_quality(dataset, [[request]])["hr1"] == 0.0
    # the counts stop before each user's second-to-last item: with "paired" there, nothing vouches for it
    late = {**histories, "u2": ["h", "x", "paired", "y"], "u3": ["h", "x", "paired", "y"]}
    assert item_knn_quality(Dataset("toy", items, late), everyone_trains, [[request]])["hr1"] == 0.0


def test_bootstrap_interval_brackets_the_mean() -> None:
    low, high = bootstrap_ci([0.0] * 30 + [1.0] * 10, seed=1)
    assert low < 0.25 < high and 0.05 < low and high < 0.45


def test_a_users_requests_move_together_in_the_interval() -> None:
    # 20 users, 5 requests each, every request of a user alike: 100 values but 20 independent ones
    values = [1.0] * 50 + [0.0] * 50
    users = [f"u{i // 5}" for i in range(100)]
    clustered = bootstrap_ci(values, seed=3, clusters=users)
    as_users = bootstrap_ci([1.0] * 10 + [0.0] * 10, seed=3)
    independent = bootstrap_ci(values, seed=3)
    assert clustered[1] - clustered[0] > 1.5 * (independent[1] - independent[0])
    assert clustered[1] - clustered[0] == pytest.approx(as_users[1] - as_users[0], abs=0.08)
    with pytest.raises(ValueError, match="users for"):
        bootstrap_ci(values, seed=3, clusters=users[:-1])


def test_paired_difference_is_exact_where_the_rankings_agree_and_signed_where_they_do_not() -> None:
    reference = [1.0, 0.0, 1.0, 0.0] * 10
    assert paired_difference(reference, reference, seed=0) == (0.0, 0.0, 0.0)
    better = [1.0] * 40  # wins every request the reference lost
    mean, low, high = paired_difference(better, reference, seed=0)
    assert mean == 0.5 and 0.3 < low < 0.5 < high < 0.7
    assert paired_difference(reference, better, seed=0)[0] == -0.5


def test_an_unprepared_finetuned_model_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSHARD_CACHE_DIR", str(tmp_path))
    assert resolve_model("finetuned") is None
    assert resolve_model("base") == tmp_path / "models" / "SmolLM2-135M-Instruct"


@pytest.mark.model
def test_tiny_run_reports_every_field_for_the_base_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.json"
    argv = ["bench", "recommender", "--models", "base", "--users", "2", "--history", "3",
            "--candidates", "4", "--permutations", "2", "--json", str(out)]
    rows = run(build_parser(argv).parse_args(argv))
    assert json.loads(out.read_text()) == rows and len(rows) == 2
    row, fused = rows
    assert fused["model"] == "SmolLM2-135M-Instruct + retrieval score" and fused["fused_with_retrieval"]
    assert not row["fused_with_retrieval"] and 0.0 <= fused["hr1"] <= 1.0
    for field in ("model", "hr1", "hr5", "ndcg10", "position_consistency", "max_label_share"):
        assert field in row
    assert row["model"] == "SmolLM2-135M-Instruct" and row["users"] == 2 and row["candidates"] == 4
    assert row["random_hr1"] == 0.25 and 0 <= row["hr1"] <= 1 and 0 < row["max_label_share"] <= 1
    assert set(row["paired"]) == {"popularity", "item_knn"}
    assert set(fused["paired"]) == {"SmolLM2-135M-Instruct", "popularity", "item_knn"}
    printed = capsys.readouterr().out
    assert "random" in printed and "paired differences" in printed


@pytest.mark.model
def test_earlier_positions_multiply_the_requests_not_the_users(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "recommender", "--models", "base", "--users", "2", "--history", "3", "--candidates", "4",
            "--permutations", "1", "--positions", "3", "--retrieval-weight", "0"]
    row, fused = run(build_parser(argv).parse_args(argv))
    assert row["users"] == 2 and row["requests"] == 6 and row["positions"] == 3
    assert "last 3 interactions" in row["target"]
    low, high = row["paired"]["item_knn"]["hr1"][1:]
    assert low <= row["paired"]["item_knn"]["hr1"][0] <= high
    assert "2 users' last items (6 requests)" in capsys.readouterr().out
    # the stage at weight 0 leaves the model's ranking as it is: the same answers, request by request
    assert fused["model"] == "SmolLM2-135M-Instruct + 0 × retrieval score" and fused["retrieval_weight"] == 0.0
    assert fused["paired"]["SmolLM2-135M-Instruct"] == {"hr1": [0.0, 0.0, 0.0], "ndcg10": [0.0, 0.0, 0.0]}
