"""What the local cluster generates: a CacheShard the CRD accepts and a Prometheus config that
promtool accepts, with the labels the rebalancer joins on."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvshard.settings import SettingsError
from kvshard_local import manifests
from kvshard_local.settings import LocalClusterSettings


def test_generated_cacheshard_is_valid_and_points_at_the_local_servers(tmp_path: Path) -> None:
    from kvshard_operator.validation import violations

    (tmp_path / "items.jsonl").write_text('{"id": "1", "text": "One"}\n')
    obj = manifests.local_cacheshard(manifests.load_cacheshard(), namespace="team", etcd_endpoint="127.0.0.1:4001",
                                     prometheus_url="http://127.0.0.1:9999", generated=True,
                                     dataset=str(tmp_path), clusters=12, rebalance_interval_seconds=10)
    assert violations(obj) == []
    spec = obj["spec"]
    assert obj["metadata"]["namespace"] == "team"
    assert spec["etcd"]["endpoints"] == ["127.0.0.1:4001"]
    assert spec["prometheus"]["url"] == "http://127.0.0.1:9999"
    assert spec["catalog"] == {"file": {"path": str(tmp_path / "items.jsonl")}, "refreshSeconds": 10}
    assert "prompt" not in spec  # the default (MovieLens) prompt
    assert (spec["clusters"], spec["rebalance"]) == (12, {"enabled": True, "intervalSeconds": 10})
    builtin = manifests.local_cacheshard(manifests.load_cacheshard(), namespace="default", etcd_endpoint="e:1",
                                         prometheus_url="http://p:1", generated=True)
    assert builtin["spec"]["catalog"] == {"builtin": "movielens-100k"}


def test_a_late_scorer_is_blended_without_recompute_unless_the_cacheshard_says_otherwise(tmp_path: Path) -> None:
    from kvshard.models import MERGE_RECORD, model_blend
    from kvshard_operator.validation import violations

    late, answer = tmp_path / "late", tmp_path / "answer"
    late.mkdir(), answer.mkdir()
    (late / MERGE_RECORD).write_text(json.dumps({"scorer": "late", "interaction": 4}))
    assert model_blend(late) == {"method": "none", "ratioPercent": 0}
    assert model_blend(answer) == {}  # no merge record: the base model, kvshard's defaults
    generated = manifests.local_cacheshard(manifests.load_cacheshard(), namespace="default", etcd_endpoint="e:1",
                                           prometheus_url="http://p:1", generated=True, blend=model_blend(late))
    assert generated["spec"]["blend"] == {"method": "none", "ratioPercent": 0} and violations(generated) == []
    mine = manifests.load_cacheshard()
    mine["spec"]["blend"] = {"method": "tail"}
    kept = manifests.local_cacheshard(mine, namespace="default", etcd_endpoint="e:1", prometheus_url="http://p:1",
                                      generated=True, blend=model_blend(late))
    assert kept["spec"]["blend"] == {"method": "tail", "ratioPercent": 0}
    assert "blend" not in manifests.local_cacheshard(manifests.load_cacheshard(), namespace="default",
                                                     etcd_endpoint="e:1", prometheus_url="http://p:1",
                                                     generated=True, blend=model_blend(answer))["spec"]


def test_a_users_cacheshard_keeps_its_own_spec_but_uses_the_local_servers(tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text(yaml.safe_dump({"apiVersion": "kvshard.io/v1alpha1", "kind": "CacheShard",
                                    "metadata": {"name": "mine"},
                                    "spec": {"clusters": 5, "catalog": {"builtin": "movielens-100k"},
                                             "etcd": {"endpoints": ["far:2379"], "secretRef": {"name": "s"}}}}))
    obj = manifests.local_cacheshard(manifests.load_cacheshard(mine), namespace="default", etcd_endpoint="near:1",
                                     prometheus_url="http://near:2", generated=False, clusters=99)
    assert obj["spec"]["clusters"] == 5 and "rebalance" not in obj["spec"]
    assert obj["spec"]["etcd"] == {"endpoints": ["near:1"], "secretRef": {"name": "s"}}
    (tmp_path / "bad.yaml").write_text("kind: Deployment\nspec: {}\n")
    with pytest.raises(ValueError, match="not a CacheShard"):
        manifests.load_cacheshard(tmp_path / "bad.yaml")
    with pytest.raises(ValueError, match="nope.yaml"):
        manifests.load_cacheshard(tmp_path / "nope.yaml")


def test_the_local_cacheshard_reaches_the_local_etcd_over_tls_with_the_local_secret(tmp_path: Path) -> None:
    from kvshard_operator.validation import violations

    mine = tmp_path / "mine.yaml"
    mine.write_text(yaml.safe_dump({"apiVersion": "kvshard.io/v1alpha1", "kind": "CacheShard",
                                    "metadata": {"name": "mine"},
                                    "spec": {"etcd": {"endpoints": ["far:2379"],
                                                      "tls": {"secretRef": {"name": "far-ca"}, "serverName": "far"}}}}))
    obj = manifests.local_cacheshard(manifests.load_cacheshard(mine), namespace="default", etcd_endpoint="near:1",
                                     prometheus_url="http://near:2", generated=False, etcd_tls_secret="local-tls")
    assert obj["spec"]["etcd"] == {"endpoints": ["near:1"], "tls": {"secretRef": {"name": "local-tls"}}}
    plain = manifests.local_cacheshard(manifests.load_cacheshard(mine), namespace="default", etcd_endpoint="near:1",
                                       prometheus_url="http://near:2", generated=False)
    assert plain["spec"]["etcd"] == {"endpoints": ["near:1"]}, "their etcd's TLS is not the local etcd's"
    generated = manifests.local_cacheshard(manifests.load_cacheshard(), namespace="default", etcd_endpoint="e:1",
                                           prometheus_url="http://p:1", generated=True, etcd_tls_secret="local-tls")
    assert violations(generated) == []


def test_prometheus_config_labels_sidecars_by_pod_and_passes_promtool(tmp_path: Path) -> None:
    config = manifests.prometheus_config(scrape_interval_seconds=2, sidecars={"engine-1": "h:2", "engine-0": "h:1"},
                                         router="h:3", operator="h:4")
    jobs = {job["job_name"]: job["static_configs"] for job in config["scrape_configs"]}
    assert jobs["kvshard-sidecar"] == [{"targets": ["h:1"], "labels": {"pod": "engine-0"}},
                                       {"targets": ["h:2"], "labels": {"pod": "engine-1"}}]
    assert jobs["kvshard-router"] == [{"targets": ["h:3"]}]  # its samples carry their own pod label
    assert jobs["kvshard-operator"] == [{"targets": ["h:4"]}]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian's prometheus package)")
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    checked = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_prompt_file_becomes_spec_prompt_and_a_bad_one_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from kvshard_operator.validation import violations

    books = Path(__file__).with_name("data")
    prompt = manifests.load_prompt(books / "books-prompt.yaml")
    assert prompt["itemFormat"] == "{text}, by {author}" and prompt["systemText"].startswith("You are a bookshop")
    obj = manifests.local_cacheshard(manifests.load_cacheshard(), namespace="default", etcd_endpoint="e:1",
                                     prometheus_url="http://p:1", generated=True, dataset=str(books / "books.jsonl"),
                                     prompt=prompt, catalog_refresh_seconds=5)
    assert violations(obj) == []
    assert obj["spec"]["prompt"] == prompt
    assert obj["spec"]["catalog"] == {"file": {"path": str(books / "books.jsonl")}, "refreshSeconds": 5}
    for text, problem in [("itemFormat: '{title}'\n", "must contain {text}"),
                          ("systemText: ''\n", "systemText: must not be empty"),
                          ("systemTxt: hi\n", "systemTxt: unknown field"),
                          ("- a list\n", "expected a mapping")]:
        (tmp_path / "prompt.yaml").write_text(text)
        with pytest.raises(ValueError, match=problem):
            manifests.load_prompt(tmp_path / "prompt.yaml")
    with pytest.raises(ValueError, match="nope.yaml"):
        LocalClusterSettings(prompt=tmp_path / "nope.yaml") and manifests.load_prompt(tmp_path / "nope.yaml")


@pytest.mark.parametrize(("field", "value"), [("pods", 0), ("threads", 0), ("rebalance_interval_seconds", 5),
                                              ("catalog_refresh_seconds", 4)])
def test_settings_refuse_values_that_cannot_run(field: str, value: int) -> None:
    changes: dict[str, Any] = {field: value}
    with pytest.raises(SettingsError, match=field):
        LocalClusterSettings(**changes)


def test_the_applied_cacheshard_carries_what_kubectl_apply_merges_against() -> None:
    obj = manifests.local_cacheshard(manifests.load_cacheshard(), namespace="default", etcd_endpoint="e:1",
                                     prometheus_url="http://p:1", generated=True)
    applied = manifests.as_applied(obj)
    assert yaml.safe_load(applied["metadata"]["annotations"][manifests.LAST_APPLIED]) == obj
    assert "annotations" not in obj["metadata"] and applied["spec"] == obj["spec"]
