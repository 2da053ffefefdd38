"""`kvshard bench embedding` runs end to end through the CLI on a few items: one row per worker count,
each the real embedding Job run as worker processes into a fresh folder, with the issue's fields
(timings are not asserted: they belong to the full measurement)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FIELDS = {"workers", "items", "chunks", "seconds", "items_per_s", "efficiency", "target_met", "cpu_seconds",
          "cpu_share"}


def test_the_bench_embeds_every_item_with_one_worker_and_with_two(tmp_path: Path) -> None:
    out = tmp_path / "embedding.json"
    done = subprocess.run([sys.executable, "-m", "kvshard.cli", "bench", "embedding", "--items", "40",
                           "--workers", "1,2", "--json", str(out), "--keep", str(tmp_path / "rows")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["workers"] for r in rows] == [1, 2]
    for row in rows:
        assert FIELDS <= set(row), row
        assert row["items"] == 40 and row["chunks"] == 4  # every row embeds every item (a fresh folder)
        assert row["seconds"] > 0 and row["items_per_s"] > 0
    assert rows[0]["efficiency"] == 1.0
    assert "efficiency" in done.stdout and "cache bypassed" in done.stdout
    # each row's pods ran as processes: one log per chunk
    assert [len(list((tmp_path / "rows" / f"workers-{n}" / "logs").glob("*.log"))) for n in (1, 2)] == [4, 4]
