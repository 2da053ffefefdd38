"""The pure parts of ``kvshard bench load``: percentiles, agreement with full prefill, the RSS of a process
tree, the closed-loop client, the rows and their ratios (no servers)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvshard_bench.load_rows import (
    ROW_KEYS,
    Answer,
    LevelResult,
    build_row,
    closed_loop,
    compare,
    format_table,
    hit_rate_at_1,
    percentile,
    plot,
    process_tree,
    ratios,
    rss_mb,
)


def test_percentiles_interpolate_between_ranks_like_numpy() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1 and percentile(values, 100) == 100
    assert percentile([7.0], 99) == 7.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_agreement_is_top1_equality_and_the_score_difference_is_the_largest_over_candidates() -> None:
    reference = [{"a": -0.1, "b": -2.0, "c": -3.0}, {"a": -1.0, "b": -0.5, "c": -4.0}]
    same_top = [{"a": -0.2, "b": -2.0, "c": -2.5}, {"a": -1.0, "b": -0.5, "c": -4.0}]
    assert compare(same_top, reference) == (1.0, pytest.approx(0.5))
    flipped = [{"a": -0.1, "b": -2.0, "c": -3.0}, {"a": -0.4, "b": -0.5, "c": -4.0}]
    assert compare(flipped, reference) == (0.5, pytest.approx(0.6))
    assert compare(reference, reference) == (1.0, 0.0)
    with pytest.raises(ValueError):
        compare([{"a": 0.0, "z": -1.0}], [{"a": 0.0, "b": -1.0}])  # not the same candidates
    with pytest.raises(ValueError):
        compare(same_top, reference[:1])


def test_hr1_counts_requests_whose_chosen_candidate_is_the_target() -> None:
    answers = [{"a": 0.0, "b": -1.0}, {"a": -1.0, "b": 0.0}, {"a": 0.0, "b": -1.0}]
    assert hit_rate_at_1(answers, ["a", "a", "b"]) == pytest.approx(1 / 3)


def test_rss_of_a_process_tree_counts_the_children() -> None:
    me = os.getpid()
    own = rss_mb(me)
    status = Path("/proc/self/status").read_text()
    vm_rss_mb = int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024
    assert own >= 0.5 * vm_rss_mb > 10  # this process (pytest + python) is well over 10 MB
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while rss_mb(child.pid) < 64 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.pid in process_tree(me) and me in process_tree(me)
        assert rss_mb(child.pid) >= 64
        assert rss_mb(me) >= rss_mb(child.pid) + 0.5 * own  # the tree: this process and its child
    finally:
        child.kill()
        child.wait()
    assert child.pid not in process_tree(me)
    assert rss_mb(child.pid) == 0  # gone


def test_the_closed_loop_keeps_at_most_in_flight_requests_and_answers_in_trace_order() -> None:
    busy, peak, lock = [0], [0], threading.Lock()

    def ask(request: int) -> Answer:
        with lock:
            busy[0] += 1
            peak[0] = max(peak[0], busy[0])
        time.sleep(0.02)
        with lock:
            busy[0] -= 1
        return Answer(0.02, {str(request): 0.0}, request)

    result = closed_loop(list(range(12)), 4, ask)
    assert peak[0] == 4 and [a.tokens_computed for a in result.answers] == list(range(12))
    assert 0.05 < result.wall_s < 1.0 and result.recs_per_s == pytest.approx(12 / result.wall_s)
    assert closed_loop(list(range(3)), 1, ask).in_flight == 1

    def fails(request: int) -> Answer:
        raise RuntimeError(f"request {request} failed")

    with pytest.raises(RuntimeError, match="failed"):
        closed_loop([1, 2], 2, fails)


def _level(in_flight: int, latencies_ms: list[float], wall_s: float, tokens: int | None = 10) -> LevelResult:
    answers = [Answer(ms / 1000, {"a": -0.1, "b": -2.0}, tokens) for ms in latencies_ms]
    return LevelResult(in_flight, answers, wall_s)


def test_a_row_carries_every_key_and_its_measures() -> None:
    references = [{"a": -0.1, "b": -2.0}] * 3 + [{"a": -3.0, "b": -0.2}]
    row = build_row("kvshard_vllm", "late", _level(2, [100, 200, 300, 400], 2.0), references,
                    ["a", "b", "a", "a"], sidecar_rss_mb=300.4, vllm_rss_mb=2500.6)
    assert set(ROW_KEYS) <= set(row)
    assert row["mode"] == "kvshard_vllm" and row["model"] == "late" and row["in_flight"] == 2
    assert row["ttft_p50_ms"] == 250.0 and row["ttft_p99_ms"] == pytest.approx(397.0)
    assert row["recs_per_s"] == 2.0 and row["tokens_computed"] == 10
    assert (row["sidecar_rss_mb"], row["vllm_rss_mb"]) == (300, 2501)
    assert row["agreement"] == 0.75 and row["max_score_diff"] == pytest.approx(2.9)
    assert row["hr1"] == 0.75 and row["requests"] == 4
    apc = build_row("vllm_apc", "scorer", _level(2, [100] * 4, 1.0, tokens=None), references[:1] * 4,
                    ["a"] * 4, None, 2000.0, tokens_computed=412.25)
    assert apc["sidecar_rss_mb"] is None and apc["tokens_computed"] == 412.2 and apc["agreement"] == 1.0
    embedded = build_row("kvshard_embedded", "late", _level(2, [100] * 4, 1.0), references[:1] * 4, ["a"] * 4,
                         500.0, None)
    assert embedded["vllm_rss_mb"] is None


def test_ratios_put_kvshard_vllm_beside_each_other_mode_at_each_level() -> None:
    refs, targets = [{"a": -0.1, "b": -2.0}] * 4, ["a"] * 4
    rows = [build_row("kvshard_vllm", "late", _level(n, [100.0 * n] * 4, 1.0 / n), refs, targets, 1, 1) for n in (1, 2)]
    rows += [build_row("kvshard_embedded", "late", _level(n, [400.0 * n] * 4, 4.0 / n), refs, targets, 1, None)
             for n in (1, 2)]
    rows += [build_row("vllm_apc", "scorer", _level(1, [200.0] * 4, 2.0), refs, targets, None, 1)]
    compared = {r["in_flight"]: r for r in ratios(rows)}
    assert compared[1] == {"in_flight": 1, "recs_per_s_vs_embedded": 4.0, "p99_vs_embedded": 0.25,
                           "recs_per_s_vs_vllm_apc": 2.0, "p99_vs_vllm_apc": 0.5}
    assert compared[2]["recs_per_s_vs_embedded"] == 4.0 and compared[2]["recs_per_s_vs_vllm_apc"] is None
    table = format_table(rows, ("mode", "in_flight", "recs_per_s", "sidecar_rss_mb"))
    assert len(table.splitlines()) == 6 and "vllm_apc" in table and " -" in table  # None shown as "-"


def test_the_plot_is_written(tmp_path: Path) -> None:
    refs, targets = [{"a": -0.1, "b": -2.0}] * 2, ["a"] * 2
    rows = [build_row(mode, "m", _level(n, [100.0, 120.0], 1.0), refs, targets, None, None)
            for mode in ("kvshard_vllm", "vllm_apc") for n in (1, 2, 4)]
    plot(rows, tmp_path / "out" / "load.png")
    assert (tmp_path / "out" / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
