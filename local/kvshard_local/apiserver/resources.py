"""The kinds the local API serves, their discovery documents, and which kind a URL names.

Discovery is what kubectl resolves ``cs``, ``cacheshard`` and ``pods`` against, so each resource
carries its singular name, short names and categories, and a subresource (``cacheshards/status``)
carries none of them — else kubectl warns that ``cs`` might also mean ``cacheshards/status``.
The CacheShard type is read from the CRD itself (:func:`from_crd`): names, printer columns, the
status subresource and the schema that admission validates against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvshard_local.apiserver import tables

VERBS = ("create", "delete", "get", "list", "patch", "update", "watch")


@dataclasses.dataclass(frozen=True)
class ResourceType:
    """One served resource (a kind in one group/version)."""

    group: str
    version: str
    plural: str
    singular: str
    kind: str
    namespaced: bool = True
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    status_subresource: bool = False
    """Status is written only through ``<plural>/status``; main-resource writes keep it as it was."""
    columns: tuple[tables.Column, ...] = ()
    """Printer columns after Name (``kubectl get``)."""
    schema: Mapping[str, Any] | None = None
    """The ``openAPIV3Schema`` objects are defaulted and validated against (custom resources)."""
    initial_status: Mapping[str, Any] | None = None
    """The status a created object starts with (a real server sets e.g. a Namespace Active)."""
    verbs: tuple[str, ...] = VERBS

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def prefix(self) -> str:
        """``/api/v1`` or ``/apis/<group>/<version>``."""
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"

    @property
    def qualified(self) -> str:
        """``cacheshards.kvshard.io`` (``pods`` in the core group), as error messages name it."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def path(self, namespace: str | None, name: str | None = None) -> str:
        parts = [self.prefix]
        if self.namespaced and namespace:
            parts.append(f"namespaces/{namespace}")
        parts.append(self.plural)
        if name:
            parts.append(name)
        return "/".join(parts)


NAMESPACES = ResourceType("", "v1", "namespaces", "namespace", "Namespace", namespaced=False, short_names=("ns",),
                          columns=tables.NAMESPACE_COLUMNS, initial_status={"phase": "Active"},
                          verbs=("create", "get", "list", "patch", "update", "watch"))
BUILTINS: tuple[ResourceType, ...] = (
    NAMESPACES,
    ResourceType("", "v1", "pods", "pod", "Pod", short_names=("po",), categories=("all",), status_subresource=True,
                 columns=tables.POD_COLUMNS, initial_status={"phase": "Pending"}),
    ResourceType("", "v1", "configmaps", "configmap", "ConfigMap", short_names=("cm",),
                 columns=tables.CONFIGMAP_COLUMNS),
    ResourceType("", "v1", "secrets", "secret", "Secret", columns=tables.SECRET_COLUMNS),
    ResourceType("", "v1", "events", "event", "Event", short_names=("ev",), columns=tables.EVENT_COLUMNS),
    # the operator's embedding Jobs (issue 19); no Job controller runs here: the local cluster's
    # (kvshard_local.job_controller) or a test runs them and writes their status as the Job controller would
    ResourceType("batch", "v1", "jobs", "job", "Job", categories=("all",), status_subresource=True,
                 columns=(tables.Column("Completions", json_path=".status.succeeded"), tables.AGE)),
)


def from_crd(crd: Mapping[str, Any]) -> list[ResourceType]:
    """One resource type per served version of a CustomResourceDefinition."""
    spec = crd["spec"]
    names = spec["names"]
    out = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        out.append(ResourceType(
            group=spec["group"], version=version["name"], plural=names["plural"],
            singular=names.get("singular") or names["kind"].lower(), kind=names["kind"],
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            short_names=tuple(names.get("shortNames") or ()), categories=tuple(names.get("categories") or ()),
            status_subresource="status" in (version.get("subresources") or {}),
            columns=tables.crd_columns(version.get("additionalPrinterColumns") or ()),
            schema=(version.get("schema") or {}).get("openAPIV3Schema")))
    return out


# --- discovery (the legacy documents; kubectl falls back to them from aggregated discovery)

def api_versions() -> dict[str, Any]:
    return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}


def _group(group: str, types: Sequence[ResourceType]) -> dict[str, Any]:
    versions = sorted({t.version for t in types if t.group == group})
    listed = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {"name": group, "versions": listed, "preferredVersion": listed[0]}


def api_group_list(types: Sequence[ResourceType]) -> dict[str, Any]:
    groups = sorted({t.group for t in types if t.group})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [_group(g, types) for g in groups]}


def api_group(types: Sequence[ResourceType], group: str) -> dict[str, Any] | None:
    if not any(t.group == group for t in types):
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(group, types)}


def api_resource_list(types: Sequence[ResourceType], group: str, version: str) -> dict[str, Any] | None:
    """The resources of one group/version, subresources as ``<plural>/status`` without names."""
    served = [t for t in types if (t.group, t.version) == (group, version)]
    if not served:
        return None
    resources: list[dict[str, Any]] = []
    for t in served:
        resources.append({"name": t.plural, "singularName": t.singular, "namespaced": t.namespaced, "kind": t.kind,
                          "verbs": list(t.verbs), "shortNames": list(t.short_names),
                          "categories": list(t.categories)})
        if t.status_subresource:
            resources.append({"name": f"{t.plural}/status", "singularName": "", "namespaced": t.namespaced,
                              "kind": t.kind, "verbs": ["get", "patch", "update"]})
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": served[0].api_version,
            "resources": resources}


# --- which resource a URL names

@dataclasses.dataclass(frozen=True)
class Target:
    """What a resource URL addresses: a collection (``name`` None) or one object (or its subresource)."""

    type: ResourceType
    namespace: str | None
    name: str | None = None
    subresource: str | None = None


def parse_path(path: str, types: Iterable[ResourceType]) -> Target | None:
    """The target of ``/api/v1/...`` or ``/apis/<group>/<version>/...``; None for anything else.

    ``/api/v1/namespaces/<name>`` is the Namespace ``<name>``, ``/api/v1/namespaces/<ns>/pods`` the
    pods in ``<ns>``: the word after a namespace name decides (kmock reads both as a namespace).
    """
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 3 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    by_plural = {t.plural: t for t in types if (t.group, t.version) == (group, version)}
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] in by_plural and by_plural[rest[2]].namespaced:
        namespace, rest = rest[1], rest[2:]
    if not rest or rest[0] not in by_plural or len(rest) > 3:
        return None
    type_ = by_plural[rest[0]]
    if type_.namespaced != (namespace is not None) and len(rest) > 1:
        return None  # a namespaced object needs its namespace; a cluster-scoped one has none
    return Target(type_, namespace, rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None)
