"""Rendered manifests against real schemas: kubernetes-validate --strict for built-in kinds, our CRD
(through the operator's validator) for CacheShards, promtool for alert rules and dashboard queries."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import (
    CHART,
    CUSTOM_GROUPS,
    KUBERNETES_VERSION,
    REPO,
    VALUES_CASES,
    Manifest,
    api_group,
    find,
    kind_name,
    promtool,
)

# What each values file renders (kind/name, release "kvs"); a change here is a change users see.
ROUTER = {
    "Deployment/kvs-kvshard-router", "Service/kvs-kvshard-router", "ServiceAccount/kvs-kvshard-router",
    "PodDisruptionBudget/kvs-kvshard-router", "ServiceMonitor/kvs-kvshard-router", "NetworkPolicy/kvs-kvshard-router",
}
# cert-manager: the chart's own etcd CA (a self-signed Issuer, the CA Certificate and its Issuer) and
# etcd's server, peer and client certificates.
ETCD_CERTIFICATES = {
    "Issuer/kvs-kvshard-etcd-selfsigned", "Certificate/kvs-kvshard-etcd-ca", "Issuer/kvs-kvshard-etcd-ca",
    "Certificate/kvs-kvshard-etcd-server", "Certificate/kvs-kvshard-etcd-peer", "Certificate/kvs-kvshard-etcd-client",
}
# The bundled etcd's defragmentation (issue 41): the CronJob and its pods' NetworkPolicy.
ETCD_DEFRAG = {"CronJob/kvs-kvshard-etcd-defrag", "NetworkPolicy/kvs-kvshard-etcd-defrag"}
EXPECTED = {
    "default": {
        "ClusterRole/kvs-kvshard-operator", "ClusterRoleBinding/kvs-kvshard-operator",
        "ConfigMap/kvs-kvshard-dashboard", "Deployment/kvs-kvshard-operator",
        "NetworkPolicy/kvs-kvshard-engine", "NetworkPolicy/kvs-kvshard-etcd", "NetworkPolicy/kvs-kvshard-operator",
        "PodDisruptionBudget/kvs-kvshard-engine", "PrometheusRule/kvs-kvshard",
        "Secret/kvs-kvshard-peer-token", "Service/kvs-kvshard-engine", "Service/kvs-kvshard-engine-peers",
        "Service/kvs-kvshard-etcd", "Service/kvs-kvshard-etcd-peers", "Service/kvs-kvshard-operator",
        "ServiceAccount/kvs-kvshard-engine", "ServiceAccount/kvs-kvshard-operator",
        "ServiceMonitor/kvs-kvshard-engine", "ServiceMonitor/kvs-kvshard-operator",
        "StatefulSet/kvs-kvshard-engine", "StatefulSet/kvs-kvshard-etcd",
    } | ROUTER | ETCD_CERTIFICATES | ETCD_DEFRAG,
}
EXPECTED["external-etcd"] = (EXPECTED["default"] - ETCD_CERTIFICATES - ETCD_DEFRAG - {
    "NetworkPolicy/kvs-kvshard-etcd", "Secret/kvs-kvshard-peer-token", "Service/kvs-kvshard-etcd",
    "Service/kvs-kvshard-etcd-peers", "StatefulSet/kvs-kvshard-etcd",
}) | {"Role/kvs-kvshard-operator", "RoleBinding/kvs-kvshard-operator", "CacheShard/kvs-kvshard-movielens"}
EXPECTED["autoscaling"] = EXPECTED["default"] | {
    "HorizontalPodAutoscaler/kvs-kvshard-engine", "CacheShard/kvs-kvshard-movielens",
}
EXPECTED["autoscaling-keda"] = EXPECTED["default"] | {"ScaledObject/kvs-kvshard-engine"}
EXPECTED["embedding"] = EXPECTED["default"]  # the Jobs are the operator's, not the chart's
EXPECTED["late-scorer"] = EXPECTED["default"]  # the same objects; the engine pod is configured otherwise
# The Gateway API Inference Extension option (issue 43): the engine pods' InferencePool and its endpoint picker.
EXPECTED["gateway-api"] = EXPECTED["default"] | {
    "InferencePool/kvs-kvshard-engine", "Deployment/kvs-kvshard-epp", "Service/kvs-kvshard-epp",
    "ServiceAccount/kvs-kvshard-epp", "NetworkPolicy/kvs-kvshard-epp", "PodDisruptionBudget/kvs-kvshard-epp",
    "ServiceMonitor/kvs-kvshard-epp",
}
EXPECTED["monitoring-off"] = (EXPECTED["default"] - {
    "ConfigMap/kvs-kvshard-dashboard", "PrometheusRule/kvs-kvshard", "ServiceMonitor/kvs-kvshard-engine",
    "ServiceMonitor/kvs-kvshard-operator", "ServiceMonitor/kvs-kvshard-router", "NetworkPolicy/kvs-kvshard-engine",
    "NetworkPolicy/kvs-kvshard-etcd", "NetworkPolicy/kvs-kvshard-operator", "NetworkPolicy/kvs-kvshard-router",
    "PodDisruptionBudget/kvs-kvshard-engine", "NetworkPolicy/kvs-kvshard-etcd-defrag",
}) | {"PodDisruptionBudget/kvs-kvshard-etcd"}  # three etcd members: drained one at a time

EXPECTED["kind"] = EXPECTED["default"] - {
    "ConfigMap/kvs-kvshard-dashboard", "PrometheusRule/kvs-kvshard", "ServiceMonitor/kvs-kvshard-engine",
    "ServiceMonitor/kvs-kvshard-operator", "ServiceMonitor/kvs-kvshard-router",
}


def _kubernetes_validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "--kubernetes-version", KUBERNETES_VERSION,
         "--quiet", str(path)],
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize("case", VALUES_CASES)
def test_each_values_file_renders_the_expected_objects(rendered: dict[str, list[Manifest]], case: str) -> None:
    names = [kind_name(o) + "@" + o["metadata"].get("namespace", "") for o in rendered[case]]
    assert len(names) == len(set(names)), "two objects share a kind, name and namespace"
    assert {kind_name(o) for o in rendered[case]} == EXPECTED[case]


@pytest.mark.parametrize("case", VALUES_CASES)
def test_builtin_objects_pass_kubernetes_validate_strict(rendered: dict[str, list[Manifest]], case: str,
                                                         tmp_path: Path) -> None:
    builtin = [o for o in rendered[case] if api_group(o) not in CUSTOM_GROUPS]
    assert builtin
    path = tmp_path / f"{case}.yaml"
    path.write_text(yaml.safe_dump_all(builtin))
    result = _kubernetes_validate(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_validate_strict_catches_an_unknown_field(rendered: dict[str, list[Manifest]],
                                                             tmp_path: Path) -> None:
    deployment = json.loads(json.dumps(find(rendered["default"], "Deployment", "-operator")))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(deployment))
    result = _kubernetes_validate(path)
    assert result.returncode != 0
    assert "'livenessProbes' was unexpected" in result.stdout + result.stderr


@pytest.mark.parametrize("case", ["external-etcd", "autoscaling"])
def test_example_cacheshard_passes_the_crd_schema(rendered: dict[str, list[Manifest]], case: str) -> None:
    from kvshard_operator import validation

    shard = find(rendered[case], "CacheShard")
    assert validation.violations(shard) == []


def test_example_cacheshard_selects_the_engine_pods(rendered: dict[str, list[Manifest]]) -> None:
    from kvshard_operator import selectors

    objects = rendered["autoscaling"]
    shard = find(objects, "CacheShard")
    engine = find(objects, "StatefulSet", "-engine")
    operator = find(objects, "Deployment", "-operator")
    assert selectors.matches(shard["spec"]["podSelector"], engine["spec"]["template"]["metadata"]["labels"])
    assert not selectors.matches(shard["spec"]["podSelector"], operator["spec"]["template"]["metadata"]["labels"])
    assert shard["spec"]["model"]["name"] == engine_model_name(engine)
    assert shard["spec"]["etcd"]["endpoints"] == ["kvs-kvshard-etcd.recommend.svc:2379"]


def engine_model_name(engine: Manifest) -> str:
    vllm = next(c for c in engine["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
    flag = next(a for a in vllm["args"] if a.startswith("--served-model-name="))
    return str(flag.split("=", 1)[1])


def test_crd_examples_in_the_chart_render_against_the_copied_crd(rendered: dict[str, list[Manifest]]) -> None:
    from kvshard_operator import crd, validation

    schema = crd.version_schema(yaml.safe_load((CHART / "crds" / crd.CRD_FILE).read_text()))
    for case in ("external-etcd", "autoscaling"):
        assert validation.violations(find(rendered[case], "CacheShard"), schema) == []


def _promtool_check_rules(groups: list[dict[str, Any]], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    tool = promtool()
    if tool is None:
        pytest.skip("promtool missing: apt-get install --no-install-recommends prometheus")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


def test_prometheus_rules_pass_promtool(rendered: dict[str, list[Manifest]], tmp_path: Path) -> None:
    rule = find(rendered["default"], "PrometheusRule")
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert {"KvshardLowHitRatio", "KvshardSidecarDown", "KvshardPlacementStale"} <= alerts
    result = _promtool_check_rules(rule["spec"]["groups"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


_GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$namespace": ".*", "$cacheshard": ".*", "$model_name": ".*"}


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    dashboard = json.loads((CHART / "dashboards" / "kvshard.json").read_text())
    rules = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in _GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"unknown Grafana variable in {panel['title']!r}: {expr}"
            rules.append({"record": f"dashboard:panel{panel['id']}_{target['refId']}:check", "expr": expr})
    result = _promtool_check_rules([{"name": "dashboard", "rules": rules}], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_covers_what_operators_watch() -> None:
    dashboard = json.loads((CHART / "dashboards" / "kvshard.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in ("kvshard_sidecar_hit_tokens_total", "kvshard_sidecar_query_tokens_total",
                   "kvshard_sidecar_ttft_seconds_bucket", "kvshard_sidecar_recompute_ratio_bucket",
                   "kvshard_operator_placement_generation", "kvshard_operator_rebalances_total",
                   "kvshard_sidecar_requests_total", "kvshard_router_requests_total"):
        assert metric in exprs
    assert {p["id"] for p in dashboard["panels"]} == set(range(1, len(dashboard["panels"]) + 1))


_METRIC = re.compile(r"(?<![:\w])(kvshard_(?:sidecar|operator)_[a-z_]+)")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def test_dashboard_and_alerts_use_metrics_the_components_export(rendered: dict[str, list[Manifest]]) -> None:
    source = (REPO / "sidecar" / "kvshard_sidecar" / "metrics.py").read_text()
    source += (REPO / "operator" / "kvshard_operator" / "metrics.py").read_text()
    text = (CHART / "dashboards" / "kvshard.json").read_text()
    text += yaml.safe_dump(find(rendered["default"], "PrometheusRule")["spec"])
    used = set(_METRIC.findall(text))
    assert used
    for name in sorted(used):
        base = name
        for suffix in _SUFFIXES:
            base = base.removesuffix(suffix)
        assert f'"{base}"' in source or f'"{base}_total"' in source, f"{name} is not exported by any component"


def test_dashboard_configmap_carries_the_dashboard_file(rendered: dict[str, list[Manifest]]) -> None:
    configmap = find(rendered["default"], "ConfigMap", "-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    on_disk = json.loads((CHART / "dashboards" / "kvshard.json").read_text())
    assert json.loads(configmap["data"]["kvshard.json"]) == on_disk
