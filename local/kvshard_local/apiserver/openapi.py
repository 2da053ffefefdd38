"""OpenAPI v3 documents generated from the served kinds (the CRD's own schema for CacheShards).

kubectl downloads them before ``apply`` (validation), for ``explain``, and to learn whether the
server validates fields itself: a PATCH operation that takes the ``fieldValidation`` query parameter
makes ``kubectl apply`` send ``fieldValidation=Strict`` and leave validation to the server, as it
does against every current cluster. Without a document kubectl stops with ``failed to download
openapi``. Built-in kinds are described loosely (any fields): the local API does not validate them.

    /openapi/v3                              index: one document per group/version
    /openapi/v3/apis/kvshard.io/v1alpha1     paths and schemas of that group/version
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvshard_local.apiserver.resources import ResourceType

OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
LIST_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ListMeta"
_META_SCHEMAS = {
    OBJECT_META: {
        "type": "object", "description": "Standard object metadata.",
        "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                       "generateName": {"type": "string"}, "uid": {"type": "string"},
                       "resourceVersion": {"type": "string"}, "generation": {"type": "integer", "format": "int64"},
                       "creationTimestamp": {"type": "string", "format": "date-time"},
                       "deletionTimestamp": {"type": "string", "format": "date-time"},
                       "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                       "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                       "finalizers": {"type": "array", "items": {"type": "string"}},
                       "ownerReferences": {"type": "array",
                                           "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                       "managedFields": {"type": "array",
                                         "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}},
    },
    LIST_META: {"type": "object",
                "properties": {"resourceVersion": {"type": "string"}, "continue": {"type": "string"}}},
}
_WRITE_PARAMETERS = [
    {"name": name, "in": "query", "description": text, "schema": {"type": "string", "uniqueItems": True}}
    for name, text in (("dryRun", "Not supported by the local API."),
                       ("fieldManager", "A name for the actor making the change."),
                       ("fieldValidation", "Ignore, Warn (default) or Strict: what to do with unknown fields."))
]


def document_path(group: str, version: str) -> str:
    """``api/v1`` or ``apis/<group>/<version>``, the index's key for a group/version."""
    return f"apis/{group}/{version}" if group else f"api/{version}"


def schema_name(type_: ResourceType) -> str:
    """``io.kvshard.v1alpha1.CacheShard``, ``io.k8s.api.core.v1.Pod``: the names a real server uses."""
    prefix = ".".join(reversed(type_.group.split("."))) if type_.group else "io.k8s.api.core"
    return f"{prefix}.{type_.version}.{type_.kind}"


def _gvk(type_: ResourceType, kind: str | None = None) -> dict[str, str]:
    return {"group": type_.group, "version": type_.version, "kind": kind or type_.kind}


def _object_schema(type_: ResourceType) -> dict[str, Any]:
    schema: dict[str, Any] = copy.deepcopy(dict(type_.schema)) if type_.schema is not None else {
        "type": "object", "description": f"{type_.kind} (fields are not validated by the local API)",
        "x-kubernetes-preserve-unknown-fields": True, "properties": {}}
    props = schema.setdefault("properties", {})
    props["metadata"] = {"allOf": [{"$ref": f"#/components/schemas/{OBJECT_META}"}], "default": {},
                         "description": "Standard object's metadata."}
    props.setdefault("apiVersion", {"type": "string"})
    props.setdefault("kind", {"type": "string"})
    schema["x-kubernetes-group-version-kind"] = [_gvk(type_)]
    return schema


def _list_schema(type_: ResourceType) -> dict[str, Any]:
    return {"type": "object", "required": ["items"],
            "x-kubernetes-group-version-kind": [_gvk(type_, f"{type_.kind}List")],
            "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                           "items": {"type": "array", "items": {"$ref": f"#/components/schemas/{schema_name(type_)}"}},
                           "metadata": {"allOf": [{"$ref": f"#/components/schemas/{LIST_META}"}], "default": {}}}}


def _operation(type_: ResourceType, action: str, verb: str, writes: bool) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{schema_name(type_)}"}
    op: dict[str, Any] = {
        "operationId": f"{verb}{type_.kind}", "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": _gvk(type_),
        "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": ref}}}},
    }
    if writes:
        op["parameters"] = copy.deepcopy(_WRITE_PARAMETERS)
    return op


def _paths(type_: ResourceType) -> dict[str, Any]:
    collection = type_.path("{namespace}")
    item = f"{collection}/{{name}}"
    paths: dict[str, Any] = {
        collection: {"get": _operation(type_, "list", "list", False),
                     "post": _operation(type_, "post", "create", True)},
        item: {"get": _operation(type_, "get", "read", False), "put": _operation(type_, "put", "replace", True),
               "patch": _operation(type_, "patch", "patch", True),
               "delete": _operation(type_, "delete", "delete", False)},
    }
    if type_.status_subresource:
        paths[f"{item}/status"] = {"get": _operation(type_, "get", "readStatus", False),
                                   "put": _operation(type_, "put", "replaceStatus", True),
                                   "patch": _operation(type_, "patch", "patchStatus", True)}
    return paths


def document(types: Sequence[ResourceType], group: str, version: str) -> dict[str, Any] | None:
    """The OpenAPI 3.0 document of one group/version, or None when it serves nothing."""
    served = [t for t in types if (t.group, t.version) == (group, version)]
    if not served:
        return None
    schemas: dict[str, Any] = copy.deepcopy(_META_SCHEMAS)
    paths: dict[str, Any] = {}
    for t in served:
        schemas[schema_name(t)] = _object_schema(t)
        schemas[f"{schema_name(t)}List"] = _list_schema(t)
        paths.update(_paths(t))
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes (kvshard local API)", "version": "v1.37.0"},
            "paths": paths, "components": {"schemas": schemas}}


def _hash(doc: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32].upper()


def index(types: Sequence[ResourceType]) -> dict[str, Any]:
    """``/openapi/v3``: where each group/version's document is (with a content hash, as kubectl caches by it)."""
    paths: dict[str, Any] = {}
    for group, version in sorted({(t.group, t.version) for t in types}):
        doc = document(types, group, version)
        assert doc is not None
        path = document_path(group, version)
        paths[path] = {"serverRelativeURL": f"/openapi/v3/{path}?hash={_hash(doc)}"}
    return {"paths": paths}
