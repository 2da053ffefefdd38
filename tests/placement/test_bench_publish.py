"""`kvshard bench placement --publish` at a tiny size against the etcd fixture."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvshard_bench import placement as bench
from kvshard_bench import placement_publish
from kvshard_local.testing_servers import EtcdServer

pytestmark = pytest.mark.slow


def test_publish_bench_reports_both_layouts(etcd_server: EtcdServer, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "publish.json"
    args = parser.parse_args(["--publish", "--items", "5000", "--pods", "10", "--clusters", "50",
                              "--rebalances", "5", "--catalog-changes", "2", "--json", str(out)])
    rows = placement_publish.run_publish(args, server=etcd_server)
    placement_publish.print_rows(rows)
    keys = {"items", "pods", "bytes_per_rebalance_generation", "bytes_per_catalog_change",
            "sidecar_read_bytes_per_rebalance", "etcd_db_bytes_after", "quota_bytes", "layout"}
    assert all(keys <= set(r) for r in rows)
    by = {r["layout"]: r for r in rows}
    old, new = by["per-generation"], by["content-addressed"]
    assert new["bytes_per_rebalance_generation"] < old["bytes_per_rebalance_generation"]
    assert new["sidecar_read_bytes_per_rebalance"] < old["sidecar_read_bytes_per_rebalance"]
    assert new["etcd_db_bytes_after"] > 0
    assert new["bytes_per_catalog_change"] > new["bytes_per_rebalance_generation"]
    # 1 % of the items relabelled: a delta, far below a whole map
    assert new["bytes_per_catalog_change"] < 0.25 * new["bytes_per_catalog_change_full_map"]
    json.dumps(rows)
