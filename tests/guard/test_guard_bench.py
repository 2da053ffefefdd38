"""``kvshard bench guard``'s pure parts: the trace, the balanced off/on block order and its chunks, the
pooled per-arm rows (agreement with its Wilson interval, the on/off ratios), the tables, and the check
counters read from a real exporter's page."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest, start_http_server

from kvshard.datasets import load_dataset
from kvshard_bench.guard import (
    Block,
    arm_rows,
    block_order,
    check_counts,
    chunks,
    format_blocks,
    format_table,
    make_trace,
    percentile,
    phase_row,
    settled_checks,
    small_catalog,
)


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


def test_blocks_alternate_in_mirrored_pairs_and_each_chunk_runs_once_per_arm() -> None:
    order = block_order(8)
    assert [arm for arm, _ in order] == ["off", "on", "on", "off", "off", "on", "on", "off"]
    assert sorted(order) == sorted((arm, chunk) for chunk in range(4) for arm in ("off", "on"))
    # balanced: the mean position of each arm's blocks is the same, so a linear drift cancels
    positions = {arm: [i for i, (a, _) in enumerate(order) if a == arm] for arm in ("off", "on")}
    assert sum(positions["off"]) == sum(positions["on"])
    assert [arm for arm, _ in block_order(2)] == ["off", "on"]
    for bad in (0, 1, 7):
        with pytest.raises(ValueError):
            block_order(bad)


def test_chunks_are_contiguous_and_differ_by_at_most_one() -> None:
    trace = [{"_index": i} for i in range(90)]
    pieces = chunks(trace, 4)
    assert [len(piece) for piece in pieces] == [23, 23, 22, 22]
    assert [body for piece in pieces for body in piece] == trace
    with pytest.raises(ValueError):
        chunks(trace[:3], 4)


def test_arm_rows_pool_the_blocks_of_each_arm_and_carry_the_on_off_ratios() -> None:
    blocks = [Block("off", [100.0, 110.0], {}, 0),
              Block("on", [120.0, 130.0], {"agree": 3.0, "skipped": 1.0}, 0),
              Block("on", [300.0, 310.0], {"agree": 2.0, "disagree": 1.0}, 1),
              Block("off", [290.0, 280.0], {}, 0)]
    off, on = arm_rows(blocks, ratio=0.3, sample_rate=0.05)
    assert (off["guard"], off["blocks"], off["requests"], off["sample_rate"]) == ("off", 2, 4, 0.0)
    assert (on["guard"], on["blocks"], on["requests"], on["failures"], on["sample_rate"]) == ("on", 2, 4, 1, 0.05)
    assert off["p50_ttft_ms"] == percentile([100.0, 110.0, 290.0, 280.0], 0.5) == 195.0
    assert on["p50_ttft_ms"] == 215.0
    assert (off["block_p50_ttft_ms"], on["block_p50_ttft_ms"]) == ([105.0, 285.0], [125.0, 305.0])
    assert (on["shadow_checks"], on["skipped"], on["agreement"]) == (6, 1, round(5 / 6, 3))
    assert on["p50_on_off"] == round(215.0 / 195.0, 3)
    assert on["p99_on_off"] == round(on["p99_ttft_ms"] / off["p99_ttft_ms"], 3)
    assert "p50_on_off" not in off
    table = format_table([off, on])
    assert "105–285" in table and "125–305" in table
    lines = format_blocks(blocks).splitlines()
    assert len(lines) == 5 and lines[2].split()[:3] == ["1", "on", "2"] and lines[3].split()[-1] == "3"


def test_settled_checks_waits_at_least_as_long_as_a_queued_check_may_wait() -> None:
    """A check that finishes after a quiet spell is counted only when the read waits ``at_least_s``
    (the bench waits the sidecar's queue age before an off block), not by a plain quiet-period read."""
    registry = CollectorRegistry()
    checks = Counter("kvshard_sidecar_fidelity_checks", "", ["result", "method", "ratio"], registry=registry)
    checks.labels("agree", "tail", "0.3").inc()
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        for at_least, expected in ((0.0, 1.0), (3.0, 3.0)):  # the late check of the first read lands meanwhile
            late = threading.Timer(2.0, checks.labels("agree", "tail", "0.3").inc)
            late.start()
            assert settled_checks([url], quiet_s=0.6, at_least_s=at_least) == {"agree": expected}
            late.join()
    finally:
        server.shutdown()
        thread.join(timeout=5)
