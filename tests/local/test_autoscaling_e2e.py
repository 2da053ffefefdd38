"""The chart's autoscaler, exercised: load rises until it adds a pod, falls until it removes one.

A two-pod local cluster runs the autoscaler loop (``autoscale=True``): every two seconds it evaluates
the chart's KEDA query (:func:`kvshard.autoscaling.pressure_query`) against the cluster's Prometheus
and applies the HPA rule. The load is the demo's ramp (:func:`kvshard_bench.demo_ramp.run`, which
drives :class:`kvshard_local.ramp.LoadRamp`; levels from the target: 1, 2, 3 requests in flight,
then 2, 1) → a third pod, then back to two, the leaving pod drained first. No request may fail in
either direction, the new pod may answer only once it reported every cluster warm, and each change
moves at most 1.1/N of the clusters. The ramp's summary (the demo's section) is printed as
``SCALE:`` lines (``pytest -s``).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_faults import placement_items

from kvshard_bench import demo_ramp
from kvshard_local import LocalCluster, manifests

pytestmark = [pytest.mark.slow, pytest.mark.model]

NEW = "engine-2"
CLUSTERS = 12
SAMPLE_EVERY = 0.25


@pytest.fixture(scope="module")
def cluster(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    folder = tmp_path_factory.mktemp("autoscale")
    manifest = manifests.load_cacheshard()
    manifest["spec"].update(catalog=manifests.catalog_source(str(small_dataset)), clusters=CLUSTERS, itemReplicas=1)
    manifest["spec"]["rebalance"] = {"enabled": False, "intervalSeconds": 15}  # only pods coming and going
    (folder / "cacheshard.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    (folder / "autoscaling.yaml").write_text(yaml.safe_dump({"autoscaling": {
        "minReplicas": 2, "maxReplicas": 3, "targetPressure": "1", "pressureWindow": "6s",
        "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0, "pods": 1, "periodSeconds": 20},
                     "scaleDown": {"stabilizationWindowSeconds": 15, "pods": 1, "periodSeconds": 20}}}}))
    local = LocalCluster(pods=2, dir=folder / "run", dataset=str(small_dataset), cacheshard=folder / "cacheshard.yaml",
                         scrape_interval_seconds=1.0, start_timeout_seconds=300, autoscale=True,
                         autoscale_values=folder / "autoscaling.yaml", autoscale_period_seconds=2.0,
                         ttft_target_seconds=60.0, pressure_window_seconds=8.0)
    with local:
        local.wait_ready(timeout=300, progress=lambda line: None)
        yield local


def test_scale_out_and_in_under_a_load_ramp_fail_no_request(cluster: LocalCluster) -> None:
    autoscaler = cluster.autoscaler
    assert autoscaler is not None and len(cluster.pod_names) == 2
    items = placement_items(cluster)
    rng, count = random.Random(0), itertools.count()

    def body() -> dict[str, Any]:
        return {"user_id": f"ramp-{next(count)}", "history": [], "candidates": rng.sample(items, 5), "max_tokens": 1}

    # the demo's entry point: the cluster's own autoscaler, the plan derived from its rules
    result = demo_ramp.run(cluster, body, timeout_s=480, sample_every_s=SAMPLE_EVERY,
                           progress=lambda line: print(f"SCALE: {line}", flush=True))
    assert not isinstance(result, str), result
    assert (result.plan.rise, result.plan.fall) == ((1, 2, 3), (2, 1))
    doc = demo_ramp.document(result)
    for line in demo_ramp.render(demo_ramp.section(doc)):
        print(f"SCALE: {line}")

    assert result.completed, result.outcome
    assert doc["failed"] == 0, doc["failures"]
    # Out and back. A later scale-out may follow on a starved machine: the pressure's latency half counts
    # TTFT against its target, so at 1 in flight slow pods can still sum above 2 — the gauge doing its job.
    assert [(len(c.before), len(c.after)) for c in result.changes][:2] == [(2, 3), (3, 2)]
    out, back = doc["decisions"][:2]
    assert out["added"] == [NEW] and back["removed"] == [NEW] and back["drains"][NEW]["drained"]
    # a poll sees the warm report at most one interval (plus the poll itself) after it was written
    assert out["warm_s"] is not None and out["serving_s"] >= out["warm_s"] - SAMPLE_EVERY - 1.0, \
        "routed to the new pod while cold"
    assert out["within_bound"] and back["within_bound"], (out["moved_fraction"], back["moved_fraction"])
    assert all(doc["hit_ratio"][part] is not None for part in ("before", "during", "after"))
