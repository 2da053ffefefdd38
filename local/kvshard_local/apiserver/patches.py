"""The patch types a Kubernetes API accepts, applied to a stored object.

* ``application/merge-patch+json`` (RFC 7386): what kopf, ``kubectl apply``/``edit`` of custom
  resources and our own clients send; ``null`` removes a key, lists are replaced.
* ``application/json-patch+json`` (RFC 6902): kopf's finalizer and status edits, guarded by a
  ``test`` of ``/metadata/resourceVersion`` — a failed test is a 422, which kopf retries.
* ``application/strategic-merge-patch+json``: what ``kubectl apply`` sends for built-in kinds. Only
  the parts such patches from kubectl use are understood: lists of objects with a ``name`` merge by
  name (``$patch: delete`` removes one), other lists are replaced, ``$``-directives are dropped.
* ``application/apply-patch+yaml`` (server-side apply) is refused with 415: field ownership is not
  tracked here, and a silent merge would pretend otherwise. ``kubectl apply`` (client side) works.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

import jsonpatch

from kvshard_local.apiserver.errors import BadRequest, Invalid, UnsupportedMediaType

MERGE = "application/merge-patch+json"
JSON = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"
TYPES = (MERGE, JSON, STRATEGIC)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: a new value; ``target`` is not modified."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def strategic_merge(target: Any, patch: Any) -> Any:
    """A strategic merge patch as ``kubectl apply`` builds it for built-in kinds (see the module doc)."""
    if isinstance(patch, list):
        return _merge_list(target if isinstance(target, list) else [], patch)
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if not k.startswith("$")}
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            out.pop(key, None)
        else:
            out[key] = strategic_merge(out.get(key), value)
    return out


def _merge_list(target: list[Any], patch: list[Any]) -> list[Any]:
    named = all(isinstance(v, Mapping) and "name" in v for v in [*target, *patch]) and patch
    if not named:
        return [copy.deepcopy(v) for v in patch if not (isinstance(v, Mapping) and "$patch" in v)]
    out = [dict(v) for v in target]
    for item in patch:
        index = next((i for i, v in enumerate(out) if v["name"] == item["name"]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                out.pop(index)
        elif index is None:
            out.append(strategic_merge({}, item))
        else:
            out[index] = strategic_merge(out[index], item)
    return out


def check_media(content_type: str) -> str:
    """The patch type of a ``Content-Type`` header, or 415 (server-side apply says why)."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media not in TYPES:
        raise UnsupportedMediaType(
            f"the body of the request was in an unknown format - accepted media types include: {', '.join(TYPES)}"
            + (" (server-side apply is not supported by the local API: use client-side `kubectl apply`)"
               if media == APPLY else ""))
    return media


def apply(content_type: str, target: Mapping[str, Any], body: bytes, *, kind: str, group: str,
          name: str) -> dict[str, Any]:
    """``target`` with the patch in ``body`` applied; 400 for a body that is not JSON, 415 for a
    patch type not served, 422 for a JSON patch that does not apply (a failed ``test`` included)."""
    media = check_media(content_type)
    try:
        patch = json.loads(body or b"null")
    except ValueError as exc:
        raise BadRequest(f"error decoding patch: {exc}") from None
    if media == JSON:
        if not isinstance(patch, list):
            raise BadRequest("a JSON patch must be a list of operations")
        try:
            result = jsonpatch.apply_patch(dict(target), patch, in_place=False)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise Invalid(kind, group, name, [("<patch>", f"the JSON patch does not apply: {exc}")]) from None
    elif not isinstance(patch, Mapping):
        raise BadRequest("a merge patch must be a JSON object")
    elif media == MERGE:
        result = merge_patch(target, patch)
    else:
        result = strategic_merge(target, patch)
    if not isinstance(result, dict):
        raise BadRequest("the patched object is not a JSON object")
    return result
