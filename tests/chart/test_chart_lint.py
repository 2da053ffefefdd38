"""The chart as a package: lint, CRDs copied from the one source, a strict values schema in sync with
values.yaml, and a `# --` comment on every value."""

from __future__ import annotations

import filecmp
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CHART, REPO, VALUES_CASES, HelmError, helm, render


@pytest.mark.parametrize("case", VALUES_CASES)
def test_helm_lint_strict_passes(helm_bin: Path, case: str) -> None:
    values = VALUES_CASES[case]
    out = helm(helm_bin, "lint", "--strict", str(CHART), *(["-f", str(values)] if values else []))
    assert "0 chart(s) failed" in out


def _notes(helm_bin: Path, *args: str) -> str:
    out = helm(helm_bin, "install", "kvs", str(CHART), "--namespace", "recommend", "--dry-run=client", *args)
    return out.split("NOTES:", 1)[1]


@pytest.mark.parametrize("case", VALUES_CASES)
def test_notes_tell_the_user_what_to_do_next(helm_bin: Path, case: str) -> None:
    values = VALUES_CASES[case]
    notes = _notes(helm_bin, *(["-f", str(values)] if values else []))
    assert "kubectl -n recommend wait cacheshard --all --for=condition=Ready" in notes
    assert "kubectl -n recommend wait cacheshard --all --for=condition=Warm" in notes
    assert 'the CacheShard "recommend/kvs-kvshard-movielens"' in notes, "names the CacheShard to create"
    assert "/v1/recommend" in notes and "/metrics" in notes
    assert "never upgrades" in notes
    router_on = yaml.safe_load(values.read_text()).get("router", {}).get("enabled", True) if values else True
    assert router_on, f"{case}: every tested values file keeps the default router"
    assert "port-forward service/kvs-kvshard-router 8200" in notes
    assert "curl -s localhost:8200/v1/recommend" in notes
    assert "rollout status deployment/kvs-kvshard-router" in notes
    assert "router.enabled is false" not in notes


def test_notes_without_the_router_send_users_to_the_engine_service(helm_bin: Path) -> None:
    notes = _notes(helm_bin, "--set", "router.enabled=false")
    assert "router.enabled is false" in notes
    assert "port-forward service/kvs-kvshard-engine 8100" in notes
    assert "kvs-kvshard-router" not in notes


def test_chart_crds_are_an_exact_copy_of_the_top_level_crds() -> None:
    source = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    copied = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert source, "crds/ holds no CRD"
    assert copied == source, "charts/kvshard/crds lists other files than crds/: run charts/sync-crds.sh"
    for name in source:
        assert filecmp.cmp(REPO / "crds" / name, CHART / "crds" / name, shallow=False), (
            f"charts/kvshard/crds/{name} differs from crds/{name}: run charts/sync-crds.sh")


def test_sync_crds_check_mode_agrees() -> None:
    result = subprocess.run(["bash", str(REPO / "charts" / "sync-crds.sh"), "--check"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("setting", ["operator.replicaCount=2", "engine.vllm.gpuMemoryUtilisation=0.5",
                                     "unknownTopLevel=true", "cacheShard.namespace=other",
                                     "router.policies=affinity"])
def test_values_schema_rejects_an_unknown_key(helm_bin: Path, setting: str) -> None:
    with pytest.raises(HelmError, match="additional properties"):
        render(helm_bin, sets=[setting])


@pytest.mark.parametrize("setting", ["engine.sidecar.memoryBytes=-1", "etcd.replicas=2",
                                     "engine.exchangeDir=/tmp/exchange", "router.policy=fastest",
                                     "cacheShard.name=Movies_Prod", "engine.sidecar.warmHistoryUsers=-1"])
def test_values_schema_rejects_a_bad_value(helm_bin: Path, setting: str) -> None:
    with pytest.raises(HelmError, match="values don't meet the specifications of the schema"):
        render(helm_bin, sets=[setting])


def test_external_etcd_needs_endpoints(helm_bin: Path) -> None:
    with pytest.raises(HelmError, match="minItems|minimum"):
        render(helm_bin, sets=["etcd.external.enabled=true"])


def _closed_keys(schema: dict[str, Any], value: Any, where: str) -> list[str]:
    """Where values.yaml and the schema disagree on the keys of a closed object."""
    if schema.get("additionalProperties") is not False or not isinstance(value, dict):
        return []
    props: dict[str, Any] = schema["properties"]
    problems = [f"{where}.{k}: in values.yaml, not in the schema" for k in value if k not in props]
    problems += [f"{where}.{k}: in the schema, not in values.yaml" for k in props if k not in value]
    for key, sub in props.items():
        if key in value:
            problems += _closed_keys(sub, value[key], f"{where}.{key}")
    return problems


def test_values_schema_is_strict_and_lists_exactly_the_keys_of_values_yaml() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert schema["additionalProperties"] is False
    assert _closed_keys(schema, values, "<root>") == []


_KEY = re.compile(r"^(\s*)([A-Za-z0-9_./-]+):")


def test_every_value_has_a_doc_comment() -> None:
    missing: list[str] = []
    comment_indent: int | None = None
    for number, line in enumerate((CHART / "values.yaml").read_text().splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("# --"):
            comment_indent = len(line) - len(line.lstrip())
            continue
        if stripped.startswith("#"):
            continue  # a continuation line of the comment above
        match = _KEY.match(line)
        if match and comment_indent != len(match.group(1)):
            missing.append(f"values.yaml:{number}: {match.group(2)}")
        if stripped:
            comment_indent = None
    assert missing == [], "keys without a `# --` comment right above them"
