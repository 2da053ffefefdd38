"""``kvshard bench guard``'s pure parts: the trace, the row (agreement with its Wilson interval), the
table with the p99 ratio, and the check counters read from a real exporter's page."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from kvshard.datasets import load_dataset
from kvshard_bench.guard import check_counts, format_table, make_trace, percentile, phase_row, small_catalog


def test_percentile_interpolates_between_order_statistics() -> None:
    assert percentile([10.0, 20.0, 30.0, 40.0], 0.5) == 25.0
    assert percentile(list(range(101)), 0.99) == pytest.approx(99.0)
    assert percentile([5.0], 0.99) == 5.0


def test_a_row_carries_agreement_with_its_wilson_interval_and_the_table_the_p99_ratio() -> None:
    off = phase_row("off", [100.0] * 99 + [200.0], {}, ratio=0.3, sample_rate=0.0, failures=0)
    on = phase_row("on", [100.0] * 99 + [210.0], {"agree": 9.0, "disagree": 1.0, "skipped": 2.0}, ratio=0.3,
                   sample_rate=0.05, failures=0)
    assert (off["shadow_checks"], off["agreement"], off["agreement_ci95"]) == (0, None, None)
    assert (on["shadow_checks"], on["skipped"], on["agreement"]) == (10, 2, 0.9)
    assert on["agreement_ci95"] == [0.596, 0.982]
    table = format_table([off, on])
    assert "p99 TTFT on/off: " in table
    assert f"{on['p99_ttft_ms'] / off['p99_ttft_ms']:.3f}" in table


def test_check_counts_sums_the_sidecar_counter_by_result() -> None:
    registry = CollectorRegistry()
    checks = Counter("kvshard_sidecar_fidelity_checks", "", ["result", "method", "ratio"], registry=registry)
    checks.labels("agree", "tail", "0.3").inc(4)
    checks.labels("agree", "tail", "0.2").inc(1)
    checks.labels("disagree", "tail", "0.3").inc(2)
    assert check_counts(generate_latest(registry).decode()) == {"agree": 5.0, "disagree": 2.0}


def test_the_trace_is_seeded_and_drawn_from_the_small_catalog(tmp_path: Path) -> None:
    movielens = load_dataset("movielens-100k")
    small = load_dataset(str(small_catalog(movielens, 30, tmp_path / "catalog")))
    assert len(small.items) == 30
    first = make_trace(small, 12, history=5, candidates=10, seed=3)
    assert first == make_trace(small, 12, history=5, candidates=10, seed=3)
    assert first != make_trace(small, 12, history=5, candidates=10, seed=4)
    for body in first:
        assert len(body["candidates"]) == 10 and set(body["candidates"]) <= set(small.items)
        assert 1 <= len(body["history"]) <= 5 and set(body["history"]) <= set(small.items)
