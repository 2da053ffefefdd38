"""Issue 41 item 3: etcd sized from the catalog, compacted, defragmented and watched.

The quota (``--quota-backend-bytes``, also the operator's ``KVSHARD_OPERATOR_ETCD_QUOTA_BYTES``) follows
``etcd.sizing``; NOTES prints the arithmetic; a catalog too big for etcd's 8 GiB fails the render; the
schema refuses nonsense; the defrag CronJob runs restricted with the client certificate only; and
``KvshardEtcdNearQuota`` fires (promtool's rule tests) above 80 % of the quota for 5 minutes.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CHART, HelmError, Manifest, container, env, find, helm, pod_spec, promtool, render

from kvshard_bench.placement_publish import chart_etcd_quota

GIB = 2**30


# The chart's arithmetic with its default sizing values, as `kvshard bench placement --publish` sizes its etcd:
# these tests hold the chart and the benchmark to the same quota.
expected_quota = chart_etcd_quota


def etcd_flags(objects: list[Manifest]) -> dict[str, str]:
    command = container(pod_spec(objects, "StatefulSet", "-etcd"), "etcd")["command"]
    return dict(arg[2:].split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)


def operator_quota(objects: list[Manifest]) -> str | None:
    value = env(container(pod_spec(objects, "Deployment", "-operator"), "operator")).get(
        "KVSHARD_OPERATOR_ETCD_QUOTA_BYTES")
    return None if value is None else str(value)


def test_defaults_give_the_2_gib_floor_and_5_minutes_of_history(rendered: dict[str, list[Manifest]]) -> None:
    flags = etcd_flags(rendered["default"])
    assert flags["quota-backend-bytes"] == str(2 * GIB) == str(expected_quota(100_000))
    assert (flags["auto-compaction-mode"], flags["auto-compaction-retention"]) == ("periodic", "5m")
    assert operator_quota(rendered["default"]) == flags["quota-backend-bytes"]
    assert operator_quota(rendered["external-etcd"]) is None  # the chart does not know an external etcd's quota


def test_ten_million_items_get_a_quota_that_fits_and_the_operator_is_told(helm_bin: Path) -> None:
    objects = render(helm_bin, sets=["etcd.sizing.catalogItems=10000000"])
    quota = int(etcd_flags(objects)["quota-backend-bytes"])
    assert quota == expected_quota(10_000_000) == 5 * GIB
    assert 10_000_000 * (14 * 3 + 80 * 2) * 2 < quota <= 8 * GIB
    assert operator_quota(objects) == str(quota)
    longer = render(helm_bin, sets=["etcd.sizing.catalogItems=10000000", "etcd.sizing.historyFactor=3",
                                    "etcd.compaction.retention=1h"])
    assert etcd_flags(longer)["quota-backend-bytes"] == str(expected_quota(10_000_000, history=3))
    assert etcd_flags(longer)["auto-compaction-retention"] == "1h"


def test_a_catalog_beyond_etcds_8_gib_fails_the_render(helm_bin: Path) -> None:
    with pytest.raises(HelmError, match="above etcd's recommended maximum of 8 GiB"):
        render(helm_bin, sets=["etcd.sizing.catalogItems=30000000"])
    # an external etcd is sized by whoever runs it
    render(helm_bin, CHART / "ci" / "external-etcd-values.yaml", sets=["etcd.sizing.catalogItems=30000000"])


@pytest.mark.parametrize("bad", ["etcd.sizing.catalogItems=0", "etcd.sizing.mapBytesPerItem=-1",
                                 "etcd.compaction.mode=hourly", "etcd.compaction.retention=soon",
                                 "etcd.defrag.schedule=nightly", "etcd.sizing.unknown=1"])
def test_the_schema_refuses_bad_sizing_values(helm_bin: Path, bad: str) -> None:
    with pytest.raises(HelmError, match="values don't meet the specifications of the schema|schema"):
        render(helm_bin, sets=[bad])


def test_revision_compaction_takes_a_count(helm_bin: Path) -> None:
    flags = etcd_flags(render(helm_bin, sets=["etcd.compaction.mode=revision", "etcd.compaction.retention=1000"]))
    assert (flags["auto-compaction-mode"], flags["auto-compaction-retention"]) == ("revision", "1000")
    with pytest.raises(HelmError):
        render(helm_bin, sets=["etcd.compaction.mode=revision", "etcd.compaction.retention=5m"])


def test_notes_print_the_sizing_arithmetic(helm_bin: Path) -> None:
    out = helm(helm_bin, "install", "kvs", str(CHART), "--namespace", "recommend", "--dry-run=client",
               "--set", "etcd.sizing.catalogItems=10000000")
    notes = out.split("NOTES:", 1)[1]
    assert "10000000 items x 202 B = 1926 MiB" in notes
    assert f"= {5 * 1024} MiB" in notes and f"--quota-backend-bytes={5 * GIB}" in notes
    assert "KvshardEtcdNearQuota fires above 80 %, 4096 MiB" in notes


def cronjob_pod(objects: list[Manifest]) -> dict[str, Any]:
    job = find(objects, "CronJob", "-etcd-defrag")
    return dict(job["spec"]["jobTemplate"]["spec"]["template"]["spec"])


def test_the_defrag_cronjob_runs_restricted_with_the_client_certificate_only(helm_bin: Path) -> None:
    objects = render(helm_bin, sets=["etcd.replicas=3"])
    job = find(objects, "CronJob", "-etcd-defrag")
    assert job["spec"]["schedule"] == "17 3 * * *" and job["spec"]["concurrencyPolicy"] == "Forbid"
    pod = cronjob_pod(objects)
    assert pod["automountServiceAccountToken"] is False and pod["restartPolicy"] == "Never"
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    assert c["image"] == container(pod_spec(objects, "StatefulSet", "-etcd"), "etcd")["image"]
    sc = c["securityContext"]
    assert (sc["readOnlyRootFilesystem"], sc["allowPrivilegeEscalation"], sc["capabilities"]) == (
        True, False, {"drop": ["ALL"]})
    assert "memory" in c["resources"]["limits"]
    assert c["command"][0] == "etcdctl" and c["command"][-1] == "defrag"
    (endpoints,) = [a.split("=", 1)[1] for a in c["command"] if a.startswith("--endpoints=")]
    assert endpoints.split(",") == [f"https://kvs-kvshard-etcd-{i}.kvs-kvshard-etcd-peers.recommend.svc:2379"
                                    for i in range(3)]
    assert [v["secret"]["secretName"] for v in pod["volumes"]] == ["kvs-kvshard-etcd-client"]
    # etcd admits the defrag pods on its client port; their own policy lets them reach only DNS and etcd
    etcd_policy = find(objects, "NetworkPolicy", "-etcd")
    components = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                  for p in etcd_policy["spec"]["ingress"][0]["from"]]
    assert "etcd-defrag" in components
    own = find(objects, "NetworkPolicy", "-etcd-defrag")
    assert own["spec"]["ingress"] == [] and len(own["spec"]["egress"]) == 2


def test_no_defrag_cronjob_for_an_external_etcd_or_when_off(rendered: dict[str, list[Manifest]],
                                                          helm_bin: Path) -> None:
    assert not [o for o in rendered["external-etcd"] if o["kind"] == "CronJob"]
    off = render(helm_bin, sets=["etcd.defrag.enabled=false"])
    assert not [o for o in off if o["kind"] == "CronJob" or o["metadata"]["name"].endswith("-etcd-defrag")]


def test_the_near_quota_alert_fires_above_80_percent_for_5_minutes(rendered: dict[str, list[Manifest]],
                                                                   tmp_path: Path) -> None:
    tool = promtool()
    if tool is None:
        pytest.skip("promtool missing: apt-get install --no-install-recommends prometheus")
    rule = find(rendered["default"], "PrometheusRule")
    groups = [g for g in rule["spec"]["groups"] if any(r.get("alert") == "KvshardEtcdNearQuota" for r in g["rules"])]
    assert groups
    (alert,) = [r for r in groups[0]["rules"] if r.get("alert") == "KvshardEtcdNearQuota"]
    assert alert["for"] == "5m" and alert["labels"]["severity"] == "warning"
    assert "alarm disarm" in alert["annotations"]["description"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    quota = 2 * GIB
    shard = 'cacheshard="recommend/items", namespace="recommend"'
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": "kvshard_operator_etcd_quota_bytes{namespace=\"recommend\"}", "values": f"{quota}x20"},
            # 50 % for 5 minutes, then 90 % from minute 6 on
            {"series": f"kvshard_operator_etcd_db_bytes{{{shard}}}",
             "values": f"{quota // 2}x5 {int(quota * 0.9)}x15"},
        ],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "KvshardEtcdNearQuota", "exp_alerts": []},
            {"eval_time": "9m", "alertname": "KvshardEtcdNearQuota", "exp_alerts": []},  # not yet 5 minutes
            {"eval_time": "12m", "alertname": "KvshardEtcdNearQuota", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "cacheshard": "recommend/items", "namespace": "recommend"},
                "exp_annotations": {k: v.replace("{{ $labels.cacheshard }}", "recommend/items")
                                    .replace("{{ $value | humanize1024 }}", "1.8Gi")
                                    for k, v in alert["annotations"].items()},
            }]},
        ],
    }]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    result = subprocess.run([tool, "test", "rules", str(tmp_path / "tests.yaml")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
