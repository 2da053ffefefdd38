"""Admission decisions of the local API, as a real server makes them: pure functions, no server."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvshard_local.apiserver import admission, patches, selectors
from kvshard_local.apiserver.errors import BadRequest, Conflict, Invalid, UnsupportedMediaType
from kvshard_local.apiserver.server import default_types

ROOT = Path(__file__).resolve().parents[2]
TYPES = {t.plural: t for t in default_types()}
NOW = "2026-01-01T00:00:00Z"


def minimal() -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((ROOT / "crds" / "examples" / "cacheshard-minimal.yaml").read_text())
    return obj


def create(body: Any, plural: str = "cacheshards", **kwargs: Any) -> dict[str, Any]:
    obj, _ = admission.prepare_create(TYPES[plural], body, "default", now=NOW, uid=lambda: "uid-1", **kwargs)
    return obj


def test_create_fills_server_metadata_defaults_and_drops_status() -> None:
    body = minimal()
    body["metadata"].update(uid="mine", generation=9, resourceVersion="5")
    body["status"] = {"conditions": [{"type": "Ready", "status": "True"}]}
    obj = create(body)
    assert obj["metadata"] == {"name": "movielens", "namespace": "default", "uid": "uid-1",
                               "creationTimestamp": NOW, "generation": 1}
    assert "status" not in obj
    assert obj["spec"]["itemReplicas"] == 1 and obj["spec"]["model"]["revision"] == "main"  # CRD defaults


def test_an_invalid_cacheshard_is_refused_naming_each_field() -> None:
    body = minimal()
    body["spec"]["clusters"] = 0
    body["spec"]["capacityPerPod"] = "lots"
    with pytest.raises(Invalid) as refused:
        create(body)
    status = refused.value.status()
    assert (status["code"], status["reason"], status["details"]["kind"]) == (422, "Invalid", "CacheShard")
    assert [c["field"] for c in status["details"]["causes"]] == ["spec.capacityPerPod", "spec.clusters"]
    assert status["message"].startswith('CacheShard.kvshard.io "movielens" is invalid: [spec.capacityPerPod: ')


def test_cel_rules_are_checked_at_admission() -> None:
    body = minimal()
    body["spec"]["catalog"] = {"builtin": "movielens-100k", "file": {"path": "/items.jsonl"}}
    with pytest.raises(Invalid) as refused:
        create(body)
    assert refused.value.status()["details"]["causes"][0]["field"] == "spec.catalog"


def test_unknown_fields_are_refused_when_strict_and_pruned_with_a_warning_otherwise() -> None:
    body = minimal()
    body["spec"]["colour"] = "red"
    with pytest.raises(Invalid, match="spec.colour: unknown field"):
        create(body, field_validation="Strict")
    obj, warnings = admission.prepare_create(TYPES["cacheshards"], body, "default", now=NOW)
    assert "colour" not in obj["spec"] and warnings == ['unknown field "spec.colour"']
    assert admission.prepare_create(TYPES["cacheshards"], body, "default", now=NOW,
                                    field_validation="Ignore")[1] == []


@pytest.mark.parametrize(("body", "error"), [
    ({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}, BadRequest),
    ({"metadata": {"name": "x", "namespace": "other"}, "spec": {}}, BadRequest),
    ({"metadata": {}}, Invalid),
    ({"metadata": {"name": "Not_A_Name"}}, Invalid),
    (["not", "an", "object"], BadRequest),
])
def test_malformed_creates(body: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        create(body)


def test_generate_name_and_a_namespace_starts_active() -> None:
    obj = create({"metadata": {"generateName": "kopf-event-"}, "reason": "Placed"}, "events")
    assert obj["metadata"]["name"] == "kopf-event-uid1"  # generateName + 5 characters
    ns, _ = admission.prepare_create(TYPES["namespaces"], {"metadata": {"name": "shop"}}, None, now=NOW)
    assert ns["status"] == {"phase": "Active"} and "namespace" not in ns["metadata"]


def stored() -> dict[str, Any]:
    obj = create(minimal())
    obj["metadata"]["resourceVersion"] = "10"
    obj["status"] = {"placementGeneration": 3}
    return obj


def test_a_main_resource_write_keeps_status_and_bumps_generation_on_spec_changes() -> None:
    old = stored()
    candidate = patches.merge_patch(old, {"spec": {"clusters": 8}, "status": {"placementGeneration": 99},
                                          "metadata": {"generation": 50, "uid": "forged", "labels": {"a": "b"}}})
    new, _ = admission.prepare_update(TYPES["cacheshards"], old, candidate)
    assert new["status"] == {"placementGeneration": 3}
    assert new["metadata"]["generation"] == 2 and new["metadata"]["uid"] == "uid-1"
    assert new["metadata"]["labels"] == {"a": "b"}
    relabelled, _ = admission.prepare_update(TYPES["cacheshards"], old, patches.merge_patch(
        old, {"metadata": {"labels": {"a": "c"}}}))
    assert relabelled["metadata"]["generation"] == 1


def test_a_status_write_changes_only_status() -> None:
    old = stored()
    candidate = patches.merge_patch(old, {"spec": {"clusters": 8}, "status": {"pods": 2}})
    new, _ = admission.prepare_update(TYPES["cacheshards"], old, candidate, subresource="status")
    assert new["spec"] == old["spec"] and new["status"] == {"placementGeneration": 3, "pods": 2}
    assert new["metadata"]["generation"] == 1


def test_a_stale_resource_version_is_a_conflict() -> None:
    old = stored()
    with pytest.raises(Conflict):
        admission.prepare_update(TYPES["cacheshards"], old, patches.merge_patch(old, {"metadata": {
            "resourceVersion": "9"}, "spec": {"clusters": 8}}))


def test_an_invalid_update_is_refused_but_untouched_invalid_fields_ratchet() -> None:
    old = stored()
    with pytest.raises(Invalid, match="spec.clusters"):
        admission.prepare_update(TYPES["cacheshards"], old, patches.merge_patch(old, {"spec": {"clusters": -1}}))
    legacy = copy.deepcopy(old)
    legacy["spec"]["clusters"] = -1  # stored before a CRD upgrade made it invalid
    new, _ = admission.prepare_update(TYPES["cacheshards"], legacy, patches.merge_patch(
        legacy, {"metadata": {"finalizers": ["kvshard.io/etcd-cleanup"]}}))
    assert new["metadata"]["finalizers"] == ["kvshard.io/etcd-cleanup"]


def test_no_new_finalizer_on_an_object_being_deleted() -> None:
    old = stored()
    old["metadata"].update(deletionTimestamp=NOW, finalizers=["a"])
    with pytest.raises(Invalid, match="finalizers"):
        admission.prepare_update(TYPES["cacheshards"], old, patches.merge_patch(
            old, {"metadata": {"finalizers": ["a", "b"]}}))
    new, _ = admission.prepare_update(TYPES["cacheshards"], old, patches.merge_patch(
        old, {"metadata": {"finalizers": None}}))
    assert "finalizers" not in new["metadata"] and new["metadata"]["deletionTimestamp"] == NOW


def test_pods_take_status_only_through_the_subresource() -> None:
    pod = create({"metadata": {"name": "engine-0"}, "spec": {"containers": [{"name": "c"}]},
                  "status": {"phase": "Running"}}, "pods")
    assert pod["status"] == {"phase": "Pending"}
    kept, _ = admission.prepare_update(TYPES["pods"], pod, patches.merge_patch(pod, {"status": {"phase": "Running"}}))
    assert kept["status"] == {"phase": "Pending"}
    assert admission.same(kept, pod)


def test_value_at_reads_dotted_label_keys_and_list_items() -> None:
    obj = {"spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "x"}}, "etcd": {"endpoints": ["a:1"]}}}
    assert admission.value_at(obj, "spec.podSelector.matchLabels.app.kubernetes.io/name") == "x"
    assert admission.value_at(obj, "spec.etcd.endpoints[0]") == "a:1"
    assert admission.value_at(obj, "spec.etcd.endpoints[3]") is admission.value_at(obj, "spec.nothing")


# --- patches and selectors

def test_merge_patch_removes_nulls_and_replaces_lists() -> None:
    assert patches.merge_patch({"a": {"b": 1, "c": 2}, "l": [1, 2]}, {"a": {"b": None, "d": 3}, "l": [3]}) == {
        "a": {"c": 2, "d": 3}, "l": [3]}


def test_strategic_merge_merges_named_lists_and_drops_directives() -> None:
    old = {"spec": {"containers": [{"name": "a", "image": "x", "ports": [{"containerPort": 80}]},
                                   {"name": "b", "image": "y"}]}}
    patch = {"spec": {"$setElementOrder/containers": [{"name": "a"}, {"name": "b"}],
                      "containers": [{"name": "a", "image": "z"}, {"name": "b", "$patch": "delete"}]}}
    assert patches.strategic_merge(old, patch) == {
        "spec": {"containers": [{"name": "a", "image": "z", "ports": [{"containerPort": 80}]}]}}


def test_patch_types() -> None:
    old = {"metadata": {"resourceVersion": "4"}, "spec": {"n": 1}}
    json_patch = b'[{"op": "test", "path": "/metadata/resourceVersion", "value": "4"},' \
                 b' {"op": "replace", "path": "/spec/n", "value": 2}]'
    assert patches.apply(patches.JSON, old, json_patch, kind="K", group="", name="x")["spec"] == {"n": 2}
    with pytest.raises(Invalid):  # a failed test is a 422, which kopf retries on a fresher object
        patches.apply(patches.JSON, old, json_patch.replace(b'"4"', b'"3"', 1), kind="K", group="", name="x")
    with pytest.raises(UnsupportedMediaType, match="server-side apply"):
        patches.apply(patches.APPLY, old, b"spec: {}", kind="K", group="", name="x")
    with pytest.raises(BadRequest):
        patches.apply(patches.MERGE, old, b"{nope", kind="K", group="", name="x")


@pytest.mark.parametrize(("selector", "labels", "matches"), [
    ("app=engine", {"app": "engine"}, True),
    ("app==engine,tier!=db", {"app": "engine", "tier": "web"}, True),
    ("app in (engine, router),!legacy", {"app": "router"}, True),
    ("app notin (engine)", {"app": "engine"}, False),
    ("team", {}, False),
])
def test_label_selectors(selector: str, labels: dict[str, str], matches: bool) -> None:
    assert selectors.label_selector(selector)(labels) is matches


def test_field_selectors_and_bad_selectors() -> None:
    event = {"metadata": {"name": "e"}, "involvedObject": {"kind": "CacheShard", "name": "local", "uid": "u"}}
    assert selectors.field_selector("involvedObject.name=local,involvedObject.uid=u")(event)
    assert not selectors.matcher(None, "metadata.name!=e")(event)
    with pytest.raises(ValueError):
        selectors.field_selector("metadata.name")
    with pytest.raises(ValueError):
        selectors.label_selector("!a in (b)")
