"""The chart's autoscaler, exercised: load rises until it adds a pod, falls until it removes one.

A two-pod local cluster runs the autoscaler loop (``autoscale=True``): every two seconds it evaluates
the chart's KEDA query (:func:`kvshard.autoscaling.pressure_query`) against the cluster's Prometheus
and applies the HPA rule. Four clients keep four requests in flight (pressure ≈ 2 per pod with
``max_concurrency`` 1) → a third pod; one client afterwards (pressure ≈ 0.5) → back to two, the
leaving pod drained first. No request may fail in either direction, the new pod may answer only
once it reported every cluster warm, and each change moves at most 1.1/N of the clusters. The
timeline is printed as ``SCALE:`` lines (``pytest -s``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from polling import wait_until
from test_faults import Traffic, placement_items, samples

from kvshard.local import LocalCluster, manifests
from kvshard.placement_schema import Placement

pytestmark = [pytest.mark.slow, pytest.mark.model]

NEW = "engine-2"
CLUSTERS = 12


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


def moved_fraction(before: Placement, after: Placement) -> float:
    changed = sum(1 for c in range(CLUSTERS) if set(before.assignment.get(c, ())) != set(after.assignment.get(c, ())))
    return changed / CLUSTERS


def hit_ratio(cluster: LocalCluster) -> tuple[float, float]:
    """The router's cluster hits and requests so far."""
    url = cluster.router_url + "/metrics"
    hits = sum(v for _, v in samples(url, "kvshard_router_cluster_hits_total"))
    asked = sum(v for _, v in samples(url, "kvshard_router_cluster_requests_total"))
    return hits, asked


class JoinWatch:
    """Polls etcd: when the new pod first reports every cluster warm (and when it left)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.joined_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                placement, reports = self.cluster.warm_reports()
            except Exception:  # etcd busy: next poll
                continue
            report = reports.get(NEW)
            if self.joined_at is None and placement is not None and NEW in placement.pods and \
                    report is not None and report.warming == 0 and report.clusters:
                self.joined_at = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def test_scale_out_and_in_under_load_fail_no_request(cluster: LocalCluster) -> None:
    autoscaler = cluster.autoscaler
    assert autoscaler is not None
    items = placement_items(cluster)
    before, _ = cluster.warm_reports()
    assert before is not None and len(before.pods) == 2
    ratios = [hit_ratio(cluster)]
    watch = JoinWatch(cluster)
    started = time.monotonic()
    try:
        with Traffic(cluster.router_url, items, workers=4) as heavy:
            wait_until(lambda: len(cluster.pod_names) == 3, timeout=120, what="the autoscaler adding a pod")
            decided = autoscaler.changes[0][0]
            wait_until(lambda: heavy.answered(NEW), timeout=240, what=f"{NEW} answering")
            first = min(s.started for s in heavy.answered(NEW))
            serving_after = time.time() - decided - (time.monotonic() - first)
            grown, _ = cluster.warm_reports()
            assert grown is not None and NEW in grown.pods
            ratios.append(hit_ratio(cluster))
            time.sleep(5)
        ratios.append(hit_ratio(cluster))
        with Traffic(cluster.router_url, items, workers=1) as light:
            wait_until(lambda: len(cluster.pod_names) == 2, timeout=180, what="the autoscaler removing a pod")
            wait_until(lambda: (p := cluster.warm_reports()[0]) is not None and NEW not in p.pods, timeout=60,
                       what=f"a placement without {NEW}")
            shrunk, _ = cluster.warm_reports()
            time.sleep(5)
        ratios.append(hit_ratio(cluster))
    finally:
        watch.stop()

    assert shrunk is not None
    changes = [change for _, change in autoscaler.changes]
    sent = heavy.snapshot() + light.snapshot()
    failures = heavy.failures() + light.failures()
    phases = ["before", "scale-out", "3 pods", "scale-in"]
    rates = [(h1 - h0) / max(1.0, a1 - a0) for (h0, a0), (h1, a1) in zip(ratios, ratios[1:], strict=False)]
    print(f"SCALE: {len(sent)} requests, {len(failures)} failed, in {time.monotonic() - started:.0f} s")
    for change in changes:
        print(f"SCALE: {len(change.before)} → {len(change.after)} pods in {change.seconds:.1f} s, "
              f"drains {change.drains}")
    print(f"SCALE: decision → {NEW} serving warm {serving_after:.1f} s; moved fraction out "
          f"{moved_fraction(before, grown):.3f}, in {moved_fraction(grown, shrunk):.3f} (bound 1.1/3 = 0.367)")
    print("SCALE: cluster hit ratio " + ", ".join(f"{p} {r:.3f}" for p, r in zip(phases[1:], rates, strict=False)))
    for e in autoscaler.evaluations[::5]:
        print(f"SCALE: eval pods {e.pods} value {e.value} → {e.desired}")

    assert not failures, failures[:5]
    assert [(len(c.before), len(c.after)) for c in changes] == [(2, 3), (3, 2)]
    assert changes[1].removed == (NEW,) and changes[1].drains[NEW]["drained"]
    assert watch.joined_at is not None and first >= watch.joined_at - 0.5, "routed to the new pod while cold"
    assert moved_fraction(before, grown) <= 1.1 / 3 and moved_fraction(grown, shrunk) <= 1.1 / 3
