"""`kvshard bench routing` on a small trace: the report has every policy and field, and the model
behaves like a cache (affinity beats cache-blind routing on hits; rebalancing actually acts)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvshard_bench import routing


def test_small_run_reports_every_policy_and_writes_json_and_png(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    routing.add_arguments(parser)
    args = parser.parse_args([
        "--pods", "16", "--requests", "4000", "--intervals", "8", "--items", "20000", "--decision-pods", "50",
        "--json", str(tmp_path / "routing.json"), "--plot", str(tmp_path / "routing.png"),
    ])
    rows = routing.run(args)

    by_policy = {row["policy"]: row for row in rows if row["front_end"] == "http"}
    assert list(by_policy) == ["round-robin", "least-loaded", "prefix-aware", "affinity", "affinity+rebalance",
                               "affinity+learned"]
    for row in rows:
        assert {"policy", "front_end", "hit_ratio", "imbalance", "p99_ms", "decision_p99_us",
                "decision_cpu_p99_us"} <= set(row)
        assert 0 < row["decision_cpu_p99_us"] and 0 < row["decision_p99_us"]
        assert 0 <= row["hit_ratio"] <= 1 and row["imbalance"] >= 1 and row["p99_ms"] > 0
    # the same trace through the EPP front end: the same choices, so the same hits and latencies
    (epp,) = [row for row in rows if row["front_end"] == "epp"]
    assert epp["policy"] == "affinity" and epp["same_choices_as_http"] is True
    assert (epp["hit_ratio"], epp["p99_ms"]) == (by_policy["affinity"]["hit_ratio"], by_policy["affinity"]["p99_ms"])
    assert epp["message_p99_us"] > 0
    assert by_policy["affinity"]["hit_ratio"] > 1.3 * by_policy["round-robin"]["hit_ratio"]
    assert by_policy["affinity+rebalance"]["rebalance_actions"] > 0
    assert by_policy["round-robin"]["rebalance_actions"] == 0
    assert by_policy["affinity+learned"]["rebalance_actions"] > 0  # colocation moved clusters
    assert json.loads((tmp_path / "routing.json").read_text()) == rows
    assert (tmp_path / "routing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
