"""What the API server decides before it stores an object: pure functions, no I/O.

The rules a real server applies and our clients rely on:

* server-managed metadata: ``uid``, ``creationTimestamp``, ``generation`` (1 at create, +1 whenever
  anything outside ``metadata`` and ``status`` changes), ``deletionTimestamp`` — clients cannot set
  or change them; ``resourceVersion`` is the store's, and a write that names an older one is a 409;
* the status subresource: where a kind has one, a main-resource write keeps the stored ``status``
  and a ``/status`` write changes nothing else; a new object starts without status (or the kind's
  initial one, such as a Pod's ``Pending``);
* custom resources are defaulted and validated against the CRD's schema and CEL rules
  (:mod:`kvshard.crd_validation`, the operator's own checks): an invalid object is a 422 naming each
  field. Unknown fields are refused with ``fieldValidation=Strict`` (what ``kubectl apply`` sends)
  and pruned with a warning otherwise, as a real server does; updates ratchet (a field left as
  invalid as it was does not block them);
* no finalizer can be added to an object being deleted.
"""

from __future__ import annotations

import copy
import re
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from kvshard import crd_validation
from kvshard_local.apiserver.errors import BadRequest, Conflict, Invalid
from kvshard_local.apiserver.resources import ResourceType

SERVER_FIELDS = ("uid", "creationTimestamp", "deletionTimestamp", "generation", "resourceVersion", "managedFields",
                 "selfLink")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def new_uid() -> str:
    return str(uuid.uuid4())


def _check_identity(type_: ResourceType, obj: Mapping[str, Any]) -> None:
    if obj.get("apiVersion", type_.api_version) != type_.api_version or obj.get("kind", type_.kind) != type_.kind:
        raise BadRequest(f"the object ({obj.get('apiVersion')}, {obj.get('kind')}) does not match the resource "
                         f"it is sent to ({type_.api_version}, {type_.kind})")


def prune(schema: Mapping[str, Any], value: Any, where: str = "") -> tuple[Any, list[str]]:
    """``value`` without the fields ``schema`` does not declare, and the dotted paths removed."""
    removed: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        keep_all = schema.get("x-kubernetes-preserve-unknown-fields") or props is None
        out: dict[str, Any] = {}
        for key, sub in value.items():
            path = f"{where}.{key}" if where else key
            if props is not None and key in props:
                out[key], gone = prune(props[key], sub, path)
            elif isinstance(extra, dict):
                out[key], gone = prune(extra, sub, path)
            elif keep_all or extra is True:
                out[key], gone = sub, []
            else:
                removed.append(path)
                continue
            removed += gone
        return out, removed
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        items = [prune(schema["items"], v, f"{where}[{i}]") for i, v in enumerate(value)]
        return [v for v, _ in items], [p for _, gone in items for p in gone]
    return value, removed


_MISSING = object()


def value_at(obj: Any, field: str) -> Any:
    """The value at a violation's field (``spec.podSelector.matchLabels.app.kubernetes.io/name``,
    ``spec.etcd.endpoints[0]``); dotted keys are matched longest first. ``_MISSING`` when absent."""
    parts = re.findall(r"\[\d+\]|[^.\[\]]+", field)
    node, i = obj, 0
    while i < len(parts):
        if parts[i].startswith("["):
            index = int(parts[i][1:-1])
            if not isinstance(node, list) or index >= len(node):
                return _MISSING
            node, i = node[index], i + 1
            continue
        if not isinstance(node, dict):
            return _MISSING
        end = next((j for j in range(i, len(parts)) if parts[j].startswith("[")), len(parts))
        for j in range(end, i, -1):
            key = ".".join(parts[i:j])
            if key in node:
                node, i = node[key], j
                break
        else:
            return _MISSING
    return node


def admit_schema(type_: ResourceType, obj: dict[str, Any], field_validation: str,
                 old: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """``obj`` defaulted and checked against the kind's schema; warnings for pruned unknown fields.
    On update (``old`` given) validation ratchets, as in Kubernetes since 1.30: a field that is as
    invalid as it was before does not block the update, so the operator can still put a finalizer
    on a CacheShard stored before a CRD upgrade tightened its rules."""
    if type_.schema is None:
        return obj, []
    name = (obj.get("metadata") or {}).get("name", "")
    warnings: list[str] = []
    if field_validation != "Strict":
        obj, pruned = prune(type_.schema, obj)
        if field_validation != "Ignore":
            warnings = [f'unknown field "{path}"' for path in pruned]
    checked = _without(obj, "status") if type_.status_subresource else obj  # status is the operator's
    found = crd_validation.violations(checked, type_.schema, api_version=type_.api_version, kind=type_.kind)
    if old is not None:
        found = [v for v in found if v.field == "<root>" or value_at(old, v.field) != value_at(checked, v.field)]
    if found:
        raise Invalid(type_.kind, type_.group, name, [(v.field, v.message) for v in found])
    return crd_validation.apply_defaults(type_.schema, obj), warnings


def prepare_create(type_: ResourceType, body: Any, namespace: str | None, *, now: str,
                   field_validation: str = "", uid: Callable[[], str] = new_uid) -> tuple[dict[str, Any], list[str]]:
    """The object to store for a POST of ``body`` (and any warnings), or an :class:`ApiError`."""
    if not isinstance(body, dict):
        raise BadRequest("the body of the request is not a JSON object")
    _check_identity(type_, body)
    obj = copy.deepcopy(body)
    obj["apiVersion"], obj["kind"] = type_.api_version, type_.kind
    meta = obj.setdefault("metadata", {})
    if not isinstance(meta, dict):
        raise BadRequest("metadata must be an object")
    if type_.namespaced:
        if meta.get("namespace") not in (None, "", namespace):
            raise BadRequest("the namespace of the provided object does not match the namespace sent on the request")
        meta["namespace"] = namespace
    else:
        meta.pop("namespace", None)
    if not meta.get("name") and meta.get("generateName"):
        meta["name"] = f"{meta['generateName']}{uid().replace('-', '')[:5]}"
    name = meta.get("name") or ""
    if not name:
        raise Invalid(type_.kind, type_.group, name,
                      [("metadata.name", "Required value: name or generateName is required")])
    if not _NAME.match(name) or len(name) > 253:
        raise Invalid(type_.kind, type_.group, name,
                      [("metadata.name", f'Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of '
                                         "lower case alphanumeric characters, '-' or '.'")])
    for key in SERVER_FIELDS:
        meta.pop(key, None)
    meta.update(uid=uid(), creationTimestamp=now, generation=1)
    if type_.status_subresource or type_.initial_status is not None:
        obj.pop("status", None)
    if type_.initial_status is not None:
        obj["status"] = copy.deepcopy(dict(type_.initial_status))
    return admit_schema(type_, obj, field_validation)


def _without(obj: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in keys}


def prepare_update(type_: ResourceType, old: Mapping[str, Any], candidate: Any, *, subresource: str | None = None,
                   field_validation: str = "") -> tuple[dict[str, Any], list[str]]:
    """The object to store when ``candidate`` (a PUT body, or the stored object with a patch
    applied) replaces ``old``, or an :class:`ApiError`. A result equal to ``old`` means no change."""
    if not isinstance(candidate, dict):
        raise BadRequest("the body of the request is not a JSON object")
    _check_identity(type_, candidate)
    old_meta = old.get("metadata") or {}
    name = old_meta.get("name", "")
    meta = candidate.get("metadata")
    if not isinstance(meta, dict):
        raise BadRequest("metadata must be an object")
    if meta.get("name", name) != name or meta.get("namespace", old_meta.get("namespace")) != old_meta.get("namespace"):
        raise BadRequest(f"the name and namespace of the object must stay {old_meta.get('namespace')}/{name}")
    if meta.get("resourceVersion") not in (None, "", old_meta.get("resourceVersion")):
        raise Conflict.stale(type_.qualified, name)
    if subresource == "status":
        new = copy.deepcopy(dict(old))
        if candidate.get("status") is None:
            new.pop("status", None)
        else:
            new["status"] = copy.deepcopy(candidate["status"])
        return new, []
    new = copy.deepcopy(candidate)
    new["apiVersion"], new["kind"] = type_.api_version, type_.kind
    for key in SERVER_FIELDS:
        new["metadata"].pop(key, None)
        if key in old_meta:
            new["metadata"][key] = copy.deepcopy(old_meta[key])
    if type_.status_subresource:
        new.pop("status", None)
        if "status" in old:
            new["status"] = copy.deepcopy(old["status"])
    if old_meta.get("deletionTimestamp"):
        added = set(new["metadata"].get("finalizers") or ()) - set(old_meta.get("finalizers") or ())
        if added:
            raise Invalid(type_.kind, type_.group, name, [("metadata.finalizers", "Forbidden: no new finalizers "
                                                           "can be added if the object is being deleted")])
    if _without(new, "metadata", "status") != _without(old, "metadata", "status"):
        new["metadata"]["generation"] = int(old_meta.get("generation") or 0) + 1
    return admit_schema(type_, new, field_validation, old)


def same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Equal but for ``resourceVersion`` (an update that changes nothing is not stored)."""
    def strip(obj: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(obj)
        out["metadata"] = _without(obj.get("metadata") or {}, "resourceVersion")
        return out

    return strip(a) == strip(b)
