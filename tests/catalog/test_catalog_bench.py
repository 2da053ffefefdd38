"""`kvshard bench catalog` runs end to end on a small catalog against a real etcd and reports the
issue's fields: a change publishes one generation, and no unchanged item moves."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvshard_bench import catalog as bench

FIELDS = {"scenario", "items", "added", "edited", "removed", "publish_seconds", "moved_unchanged_items",
          "diff_seconds", "operator_peak_mb"}


def test_a_small_change_moves_no_unchanged_item(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "catalog.json"
    args = parser.parse_args(["--items", "3000", "--clusters", "12", "--added-percent", "2", "--edited-percent", "1",
                              "--removed-percent", "1", "--json", str(out)])
    initial, change = bench.run(args)
    assert FIELDS <= set(initial) and FIELDS <= set(change)
    assert (initial["scenario"], initial["items"]) == ("initial", 3000)
    assert (change["scenario"], change["added"], change["edited"], change["removed"]) == ("change", 60, 30, 30)
    assert change["items"] == 3000 + 60 - 30
    assert change["moved_unchanged_items"] == 0
    assert 0 < change["publish_seconds"] and 0 < change["operator_peak_mb"]
    assert json.loads(out.read_text()) == [initial, change]
