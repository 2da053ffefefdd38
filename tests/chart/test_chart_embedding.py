"""Embedding Jobs in the chart (issue 19): off by default (no Job rights at all); on, the operator may
create and get Jobs and nothing more on them, mounts the shared volume, and is told the Job
pods' image, resources, parallelism and chunk size; a missing volume claim is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from chart_helpers import CI_VALUES, HelmError, Manifest, find, pod_spec, render


def job_rules(objects: list[Manifest]) -> list[Manifest]:
    role = find(objects, "ClusterRole", "operator")
    return [r for r in role["rules"] if "jobs" in r.get("resources", [])]


def test_off_by_default_the_operator_has_no_job_rights(helm_bin: Path) -> None:
    objects = render(helm_bin)
    assert job_rules(objects) == []
    env = {e["name"] for e in pod_spec(objects, "Deployment", "operator")["containers"][0]["env"]}
    assert not any(name.startswith("KVSHARD_OPERATOR_EMBEDDING_") for name in env)


def test_on_the_operator_gets_job_rights_the_volume_and_the_job_settings(helm_bin: Path) -> None:
    objects = render(helm_bin, CI_VALUES / "embedding-values.yaml")
    assert job_rules(objects) == [{"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get"]}]
    pod = pod_spec(objects, "Deployment", "operator")
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env["KVSHARD_OPERATOR_EMBEDDING_VOLUME_CLAIM"] == "kvshard-embeddings"
    assert env["KVSHARD_OPERATOR_EMBEDDING_PARALLELISM"] == "4"
    assert env["KVSHARD_OPERATOR_EMBEDDING_IMAGE"].startswith("ghcr.io/kvshard/kvshard-operator:")
    assert (env["KVSHARD_OPERATOR_EMBEDDING_CPU"], env["KVSHARD_OPERATOR_EMBEDDING_MEMORY"]) == ("1", "1Gi")
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "embeddings")
    assert mount["mountPath"] == env["KVSHARD_OPERATOR_EMBEDDING_ROOT"] == "/var/lib/kvshard/embeddings"
    volume = next(v for v in pod["volumes"] if v["name"] == "embeddings")
    assert volume == {"name": "embeddings", "persistentVolumeClaim": {"claimName": "kvshard-embeddings"}}

    namespaced = render(helm_bin, CI_VALUES / "embedding-values.yaml", sets=["operator.watchNamespaces={shop}"])
    role = find(namespaced, "Role", "operator")
    assert any("jobs" in r.get("resources", []) for r in role["rules"])


def test_enabled_without_a_volume_claim_is_refused(helm_bin: Path) -> None:
    with pytest.raises(HelmError, match="volumeClaim"):
        render(helm_bin, sets=["operator.embedding.enabled=true"])
