"""What kubectl reads before it prints anything: discovery, the table from printer columns, OpenAPI."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from kvshard import crd
from kvshard_local.apiserver import openapi, resources, tables
from kvshard_local.apiserver.server import default_types

NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
TYPES = default_types()
CACHESHARDS = next(t for t in TYPES if t.plural == "cacheshards")


def shard(**status: Any) -> dict[str, Any]:
    return {"apiVersion": "kvshard.io/v1alpha1", "kind": "CacheShard",
            "metadata": {"name": "local", "namespace": "default", "creationTimestamp": "2026-01-01T11:56:40Z"},
            "spec": {}, "status": status}


def test_discovery_names_the_singular_and_short_names_but_not_for_subresources() -> None:
    found = resources.api_resource_list(TYPES, "kvshard.io", "v1alpha1")
    assert found is not None
    by_name = {r["name"]: r for r in found["resources"]}
    assert by_name["cacheshards"]["singularName"] == "cacheshard"
    assert by_name["cacheshards"]["shortNames"] == ["cs"] and by_name["cacheshards"]["categories"] == ["kvshard", "all"]
    assert by_name["cacheshards/status"] == {"name": "cacheshards/status", "singularName": "", "namespaced": True,
                                             "kind": "CacheShard", "verbs": ["get", "patch", "update"]}
    core = resources.api_resource_list(TYPES, "", "v1")
    assert core is not None
    assert {r["name"]: r["singularName"] for r in core["resources"] if "/" not in r["name"]} == {
        "namespaces": "namespace", "pods": "pod", "configmaps": "configmap", "secrets": "secret", "events": "event"}
    assert resources.api_resource_list(TYPES, "kvshard.io", "v9") is None
    groups = {g["name"]: g for g in resources.api_group_list(TYPES)["groups"]}
    assert set(groups) == {"batch", "kvshard.io"}  # batch: the operator's embedding Jobs
    assert groups["kvshard.io"]["preferredVersion"]["groupVersion"] == "kvshard.io/v1alpha1"


@pytest.mark.parametrize(("path", "expected"), [
    ("/api/v1/namespaces", ("namespaces", None, None, None)),
    ("/api/v1/namespaces/default", ("namespaces", None, "default", None)),
    ("/api/v1/namespaces/default/pods", ("pods", "default", None, None)),
    ("/api/v1/namespaces/default/pods/engine-0/status", ("pods", "default", "engine-0", "status")),
    ("/api/v1/pods", ("pods", None, None, None)),
    ("/apis/kvshard.io/v1alpha1/namespaces/ns1/cacheshards/local", ("cacheshards", "ns1", "local", None)),
    ("/apis/kvshard.io/v1alpha1/cacheshards", ("cacheshards", None, None, None)),
])
def test_paths_name_their_resource_namespaces_included(path: str, expected: tuple[Any, ...]) -> None:
    target = resources.parse_path(path, TYPES)
    assert target is not None
    assert (target.type.plural, target.namespace, target.name, target.subresource) == expected


@pytest.mark.parametrize("path", ["/api/v1/pods/engine-0", "/api/v1/widgets", "/apis/kvshard.io/v1alpha1",
                                  "/apis/other.io/v1/things", "/version"])
def test_paths_that_name_no_resource(path: str) -> None:
    assert resources.parse_path(path, TYPES) is None


def test_printer_columns_come_from_the_crd() -> None:
    names = [c.name for c in CACHESHARDS.columns]
    assert names[:7] == ["Ready", "Warm", "Clusters", "Pods", "Generation", "Age", "Warm Clusters"]
    wide = {c.name for c in CACHESHARDS.columns if c.priority == 1}
    assert wide == {"Warm Clusters", "Warm Pods", "Ratio", "Fidelity", "Message"}


def test_a_table_row_per_object_from_the_printer_columns() -> None:
    ready = {"type": "Ready", "status": "True", "message": "16 items"}
    obj = shard(conditions=[{"type": "Warm", "status": "False"}, ready], clusters=4, pods=1, placementGeneration=2)
    table = tables.table(CACHESHARDS.columns, [obj], resource_version="7", now=NOW)
    assert table["kind"] == "Table" and table["metadata"]["resourceVersion"] == "7"
    assert [c["name"] for c in table["columnDefinitions"]][:3] == ["Name", "Ready", "Warm"]
    cells = dict(zip([c["name"] for c in table["columnDefinitions"]], table["rows"][0]["cells"], strict=True))
    assert cells == {"Name": "local", "Ready": "True", "Warm": "False", "Clusters": 4, "Pods": 1, "Generation": 2,
                     "Age": "3m20s", "Warm Clusters": None, "Warm Pods": None, "Ratio": None, "Fidelity": None,
                     "Message": "16 items"}
    assert table["rows"][0]["object"]["kind"] == "PartialObjectMetadata"
    assert "object" not in tables.table(CACHESHARDS.columns, [obj], include="None")["rows"][0]
    assert tables.table(CACHESHARDS.columns, [obj], include="Object")["rows"][0]["object"] == obj


@pytest.mark.parametrize(("seconds", "shown"), [
    (-5, "<invalid>"), (-1, "0s"), (0, "0s"), (119, "119s"), (200, "3m20s"), (240, "4m"), (700, "11m"),
    (3 * 3600 + 120, "3h2m"), (30 * 3600, "30h"), (3 * 86400 + 3600, "3d1h"), (20 * 86400, "20d"),
    (3 * 365 * 86400, "3y"), (10 * 365 * 86400, "10y"),
])
def test_ages_read_like_kubectl(seconds: float, shown: str) -> None:
    assert tables.human_duration(seconds) == shown


def test_jsonpath_subset_of_printer_columns() -> None:
    obj = {"status": {"conditions": [{"type": "Warm", "status": "False"}, {"type": "Ready", "status": "True"}],
                      "list": [1, 2]}}
    assert tables.jsonpath(obj, '.status.conditions[?(@.type=="Ready")].status') == ["True"]
    assert tables.jsonpath(obj, "{.status.list[1]}") == [2]
    assert tables.jsonpath(obj, ".status.list[*]") == [1, 2]
    assert tables.jsonpath(obj, ".status.missing.deeper") == []
    with pytest.raises(ValueError):
        tables.jsonpath(obj, ".status..recursive")


def test_builtin_pod_columns() -> None:
    pod = {"metadata": {"name": "engine-0", "creationTimestamp": "2026-01-01T11:59:00Z"},
           "spec": {"containers": [{"name": "sidecar"}]},
           "status": {"phase": "Running", "podIP": "127.0.0.1",
                      "containerStatuses": [{"ready": True, "restartCount": 2}]}}
    type_ = next(t for t in TYPES if t.plural == "pods")
    assert tables.table(type_.columns, [pod], now=NOW)["rows"][0]["cells"] == [
        "engine-0", "1/1", "Running", 2, "60s", "127.0.0.1", None]


def test_openapi_index_and_crd_document() -> None:
    index = openapi.index(TYPES)["paths"]
    assert set(index) == {"api/v1", "apis/batch/v1", "apis/kvshard.io/v1alpha1"}
    url = index["apis/kvshard.io/v1alpha1"]["serverRelativeURL"]
    assert url.startswith("/openapi/v3/apis/kvshard.io/v1alpha1?hash=")
    doc = openapi.document(TYPES, "kvshard.io", "v1alpha1")
    assert doc is not None
    schema = doc["components"]["schemas"]["io.kvshard.v1alpha1.CacheShard"]
    assert schema["properties"]["spec"] == crd.version_schema(crd.load_crd())["properties"]["spec"]
    assert schema["x-kubernetes-group-version-kind"] == [{"group": "kvshard.io", "version": "v1alpha1",
                                                          "kind": "CacheShard"}]
    patch = doc["paths"]["/apis/kvshard.io/v1alpha1/namespaces/{namespace}/cacheshards/{name}"]["patch"]
    # what makes kubectl leave field validation to the server (fieldValidation=Strict)
    assert {"name": "fieldValidation", "in": "query"}.items() <= next(
        p for p in patch["parameters"] if p["name"] == "fieldValidation").items()
    assert patch["x-kubernetes-group-version-kind"]["kind"] == "CacheShard"
    assert openapi.document(TYPES, "apps", "v1") is None
