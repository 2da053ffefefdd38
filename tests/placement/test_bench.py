"""The placement benchmark runs end to end on a small catalog and reports the documented fields."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvshard_bench import placement as bench


def test_small_bench_reports_moves_close_to_ideal(tmp_path: Path, capsys: object) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "placement.json"
    args = parser.parse_args(["--items", "20000", "--pods", "20", "--clusters", "400", "--dim", "32",
                              "--json", str(out)])
    rows = bench.run(args)
    assert {r["change"] for r in rows} == {"add", "remove"}
    for row in rows:
        assert {"items", "pods", "seconds", "moved_fraction", "ideal_fraction"} <= set(row)
        assert 0 < row["moved_fraction"] <= 1.1 * row["ideal_fraction"]
    assert json.loads(out.read_text()) == rows
