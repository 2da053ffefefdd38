"""``kvshard bench store`` runs end to end and writes the rows it promises (tiny sizes)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvshard_bench import store as bench


def test_store_bench_writes_a_row_per_tier_and_operation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "store.json"
    args = parser.parse_args(
        ["--block-tokens", "2", "--blocks", "3", "--large-block-tokens", "4", "--large-blocks", "2"]
        + ["--disk-root", str(tmp_path / "disk"), "--json", str(out)]
    )
    rows = bench.run(args)
    assert json.loads(out.read_text()) == rows
    assert [(r["tier"], r["op"]) for r in rows[:5]] == [
        ("memory", "put"),
        ("memory", "get"),
        ("disk", "put"),
        ("disk", "get"),
        ("disk", "get-cached"),
    ]
    assert {r["block_bytes"] for r in rows} == {30 * 3 * 64 * 4 * 2 * 2, 30 * 3 * 64 * 4 * 2 * 4}
    assert all(isinstance(r["mb_per_s"], float) and r["mb_per_s"] > 0 for r in rows)
    assert "SmolLM2-135M item block" in capsys.readouterr().out
