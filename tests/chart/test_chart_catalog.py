"""The chart carries a user's catalog and prompt: the example CacheShard takes any catalog source
(a URL with a token Secret included) and ``spec.prompt`` from values, the operator alone mounts a
file catalog's volume and may read the ConfigMaps and Secrets those sources name, and the
values file NOTES prints renders a CacheShard the CRD accepts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CHART, HelmError, Manifest, find, helm, pod_spec, render

PROMPT = {"systemText": "You are a bookshop's recommender. Pick the book the reader buys next.",
          "itemFormat": "{text}, by {author}"}


def values_file(tmp_path: Path, values: dict[str, Any]) -> Path:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def shard_of(objects: list[Manifest]) -> Manifest:
    from kvshard_operator import validation

    shard = find(objects, "CacheShard")
    assert validation.violations(shard) == [], validation.violations(shard)
    return shard


def test_a_url_catalog_with_a_token_secret_and_a_prompt_reach_the_example(helm_bin: Path, tmp_path: Path) -> None:
    url = {"url": "https://catalog.shop.internal/items.jsonl", "secretRef": {"name": "catalog-token", "key": "token"}}
    objects = render(helm_bin, values_file(tmp_path, {"exampleCacheShard": {
        "enabled": True, "catalog": {"url": url, "refreshSeconds": 30}, "prompt": PROMPT}}))
    spec = shard_of(objects)["spec"]
    assert spec["catalog"] == {"url": url, "refreshSeconds": 30}, "the built-in default gives way to the URL"
    assert spec["prompt"] == PROMPT
    # the sidecars learn catalog and prompt from the CacheShard: no catalog flag reaches them
    engine = yaml.safe_dump(pod_spec(objects, "StatefulSet", "-engine"))
    assert "--dataset" not in engine and "catalog" not in engine.lower()


def test_the_default_example_keeps_the_builtin_catalog_and_the_default_prompt(helm_bin: Path) -> None:
    spec = shard_of(render(helm_bin, sets=["exampleCacheShard.enabled=true"]))["spec"]
    assert spec["catalog"] == {"builtin": "movielens-100k"}
    assert "prompt" not in spec


def test_two_catalog_sources_are_refused_naming_both(helm_bin: Path, tmp_path: Path) -> None:
    values = values_file(tmp_path, {"exampleCacheShard": {"enabled": True, "catalog": {
        "configMap": {"name": "items", "key": "items.jsonl"}, "url": {"url": "https://x.example/items.jsonl"}}}})
    with pytest.raises(HelmError, match="set at most one of configMap, file, url \\(got configMap, url\\)"):
        render(helm_bin, values)
    bad_prompt = values_file(tmp_path, {"exampleCacheShard": {"enabled": True, "prompt": {"itemFormat": "{title}"}}})
    with pytest.raises(HelmError, match="itemFormat"):
        render(helm_bin, bad_prompt)
    with pytest.raises(HelmError, match="systemTxt"):
        render(helm_bin, sets=["exampleCacheShard.prompt.systemTxt=typo"])


def test_a_file_catalog_is_mounted_read_only_in_the_operator_alone(helm_bin: Path, tmp_path: Path) -> None:
    objects = render(helm_bin, values_file(tmp_path, {
        "operator": {"catalogVolume": {"persistentVolumeClaim": {"claimName": "catalogs"}}},
        "exampleCacheShard": {"enabled": True, "catalog": {"file": {"path": "/catalog/items.jsonl"}}}}))
    assert shard_of(objects)["spec"]["catalog"] == {"file": {"path": "/catalog/items.jsonl"}, "refreshSeconds": 60}
    operator = pod_spec(objects, "Deployment", "-operator")
    assert {"name": "catalog", "persistentVolumeClaim": {"claimName": "catalogs"}} in operator["volumes"]
    mounts = operator["containers"][0]["volumeMounts"]
    assert {"name": "catalog", "mountPath": "/catalog", "readOnly": True} in mounts
    assert "catalogs" not in yaml.safe_dump(pod_spec(objects, "StatefulSet", "-engine"))
    default = pod_spec(render(helm_bin), "Deployment", "-operator")
    assert [v["name"] for v in default["volumes"]] == ["tmp"], "no catalog volume unless asked for"


@pytest.mark.parametrize("watch", [[], ["shop"]])
def test_the_operator_may_read_the_configmaps_and_secrets_catalog_sources_name(helm_bin: Path, watch: list[str],
                                                                               tmp_path: Path) -> None:
    objects = render(helm_bin, values_file(tmp_path, {"operator": {"watchNamespaces": watch}}))
    role = find(objects, "Role" if watch else "ClusterRole", "-operator")
    granted = {(resource, verb) for rule in role["rules"] if rule.get("apiGroups") == [""]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert {("configmaps", "get"), ("secrets", "get")} <= granted
    assert ("configmaps", "list") not in granted and ("configmaps", "watch") not in granted, "by name only"
    # Secrets are also listed and watched, for the operator's index of etcd Secrets (issue 41; the
    # catalog URL's token is still read by name), never written
    assert {("secrets", "list"), ("secrets", "watch")} <= granted
    assert not {verb for resource, verb in granted if resource == "secrets"} - {"get", "list", "watch"}


def test_the_values_file_the_notes_print_renders_a_valid_cacheshard(helm_bin: Path, tmp_path: Path) -> None:
    out = helm(helm_bin, "install", "kvs", str(CHART), "--namespace", "recommend", "--dry-run=client")
    notes = out.split("NOTES:", 1)[1]
    assert "Your own catalog and prompt" in notes
    block = re.search(r"cat > catalog-values.yaml <<'EOF'\n(.*?)\n\s*EOF\n", notes, re.S)
    assert block is not None, notes
    lines = block.group(1).splitlines()
    indent = len(lines[0]) - len(lines[0].lstrip())
    path = tmp_path / "catalog-values.yaml"
    path.write_text("\n".join(line[indent:] for line in lines) + "\n")
    spec = shard_of(render(helm_bin, path))["spec"]
    assert spec["catalog"] == {"configMap": {"name": "shop-items", "key": "items.jsonl"}, "refreshSeconds": 60}
    assert spec["prompt"]["itemFormat"] == "{text} by {author}"
