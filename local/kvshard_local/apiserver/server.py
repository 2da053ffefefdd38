"""The local Kubernetes API: kmock's scaffold answering kubectl like a real API server.

kmock gives the HTTP server, request parsing, its test DSL (a test can still add ``api['get …'] <<
reaction`` in front) and the ``/version`` endpoint. Its emulator stores objects as plain merged
dicts with no resourceVersion, lists without ``kind``, discovery without singular names, and
misreads ``/api/v1/namespaces/<name>``; kubectl trips over each of these. So one low-priority
reaction (:meth:`LocalKubeApi._serve`) takes every ``/api``, ``/apis`` and ``/openapi`` request
and answers it from the pure parts of this package:

* discovery and OpenAPI v3 (:mod:`.resources`, :mod:`.openapi`);
* lists with ``kind``/``apiVersion``, tables from printer columns on ``as=Table`` (:mod:`.tables`),
  label and field selectors (:mod:`.selectors`);
* create, update (PUT), patch (:mod:`.patches`) and delete through admission (:mod:`.admission`):
  server-managed metadata, the status subresource, CRD schema + CEL validation, finalizers;
* watches from any kept resourceVersion, with ``sendInitialEvents`` and ``timeoutSeconds``
  (:mod:`.store`).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, cast

import aiohttp.web
import attrs
import kmock
from kmock import Response  # type: ignore[attr-defined]  # in kmock's root, but not in its __all__

from kvshard import crd
from kvshard_local.apiserver import admission, openapi, patches, resources, selectors, tables
from kvshard_local.apiserver.errors import ApiError, BadRequest, Conflict, MethodNotAllowed, NotFound
from kvshard_local.apiserver.resources import ResourceType, Target
from kvshard_local.apiserver.store import Store

SERVED_PATHS = re.compile(r"/(api|apis|openapi)(/.*)?")
INITIAL_EVENTS_END = "k8s.io/initial-events-end"
NAMESPACE_LIST = "/api/v1/namespaces"


def default_types() -> list[ResourceType]:
    """The built-in kinds the local cluster uses and every served version of the CacheShard CRD."""
    return [*resources.BUILTINS, *resources.from_crd(crd.load_crd())]


def timestamp(at: datetime.datetime | None = None) -> str:
    moment = at or datetime.datetime.now(datetime.UTC)
    return moment.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _header(request: kmock.Request, name: str) -> str:
    wanted = name.lower()
    return next((v for k, v in request.headers.items() if k.lower() == wanted), "")


def _json_body(request: kmock.Request) -> Any:
    try:
        return json.loads(request.body or b"null")
    except ValueError as exc:
        raise BadRequest(f"the body of the request is not JSON: {exc}") from None


def _reply(status: int, body: Any, warnings: Sequence[str] = (), content_type: str | None = None) -> kmock.Payload:
    """``body`` with a status and headers. kmock keeps a reply's headers on the reaction that sent it,
    so every reply names every header it may set (None: not this time)."""
    warning = ", ".join('299 - "' + w.replace('"', '\\"') + '"' for w in warnings) or None
    headers = {"Warning": warning, "Content-Type": content_type}
    return cast(kmock.Payload, Response(status=status, payload=body, headers=headers))


@attrs.define(kw_only=True)
class LocalKubeApi(kmock.KubernetesScaffold):
    """A kmock handler serving ``types`` from ``store``; serve it with ``kmock.Server(api)``."""

    types: list[ResourceType] = attrs.field(factory=default_types)
    store: Store = attrs.field(factory=Store)
    namespaces: Sequence[str] = ("default",)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        (self.fallback ** 1)[SERVED_PATHS] << self._serve  # above kmock's own fallbacks
        for namespace in self.namespaces:
            self.put_unchecked(resources.NAMESPACES, {"metadata": {"name": namespace}})

    def type_of(self, plural: str, group: str = "") -> ResourceType:
        return next(t for t in self.types if (t.plural, t.group) == (plural, group))

    def put_unchecked(self, type_: ResourceType, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Store ``obj`` as if it had passed admission long ago (server metadata filled in, nothing
        validated): the local cluster's namespaces, or a test's CacheShard that a later CRD forbids."""
        body = json.loads(json.dumps(obj))
        body["apiVersion"], body["kind"] = type_.api_version, type_.kind
        meta = body.setdefault("metadata", {})
        meta.setdefault("uid", admission.new_uid())
        meta.setdefault("creationTimestamp", timestamp())
        meta.setdefault("generation", 1)
        if type_.initial_status is not None:
            body.setdefault("status", dict(type_.initial_status))
        return self.store.put(type_.qualified, body)

    # --- kmock hooks

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock 0.8's path parser raises on the Namespace collection before any reaction runs; an
        # empty segment gets it through (our own parser skips empty segments).
        if raw_request.path.rstrip("/") == NAMESPACE_LIST:
            query = f"?{raw_request.query_string}" if raw_request.query_string else ""
            raw_request = raw_request.clone(rel_url=f"/api/v1//namespaces{query}")
        return await super().__call__(raw_request)

    async def _serve_server_version(self, request: kmock.Request) -> kmock.Payload:
        return {"major": "1", "minor": "37", "gitVersion": "v1.37.0-kvshard_local", "gitTreeState": "clean",
                "platform": "linux/amd64", "compiler": "python"}

    async def _serve_root(self, request: kmock.Request) -> kmock.Payload:
        groups = {t.prefix for t in self.types} | {f"/apis/{t.group}" for t in self.types if t.group}
        return {"paths": sorted({"/api", "/apis", "/version", "/openapi/v3"} | groups)}

    async def _serve(self, request: kmock.Request) -> kmock.Payload:
        try:
            return self._dispatch(request)
        except ApiError as exc:
            return _reply(exc.code, exc.status())

    # --- routing

    def _dispatch(self, request: kmock.Request) -> kmock.Payload:
        path = request.url.path.rstrip("/") or "/"
        parts = [p for p in path.split("/") if p]
        document = self._discovery(parts) if request.method == "GET" else None
        if document is not None:
            return _reply(200, document)
        target = resources.parse_path(path, self.types)
        if target is None:
            raise NotFound.path()
        verb = self._verb(request, target)
        if verb not in target.type.verbs:
            raise MethodNotAllowed(f"{verb} is not supported on {target.type.qualified} by the local API")
        if verb == "watch":
            return _reply(200, self._watch(request, target), content_type="application/json")
        if verb == "list":
            return _reply(200, self._list(request, target))
        if verb == "get":
            return _reply(200, self._get(request, target))
        if verb == "create":
            return self._create(request, target)
        if verb in ("update", "patch"):
            return self._update(request, target, verb)
        return self._delete(request, target)

    def _discovery(self, parts: list[str]) -> dict[str, Any] | None:
        found: dict[str, Any] | None = None
        if parts == ["api"]:
            found = resources.api_versions()
        elif parts == ["apis"]:
            found = resources.api_group_list(self.types)
        elif len(parts) == 2 and parts[0] == "apis":
            found = resources.api_group(self.types, parts[1])
        elif len(parts) == 2 and parts[0] == "api" or len(parts) == 3 and parts[0] == "apis":
            found = resources.api_resource_list(self.types, "" if parts[0] == "api" else parts[1], parts[-1])
        elif parts == ["openapi", "v3"]:
            found = openapi.index(self.types)
        elif parts[:2] == ["openapi", "v3"] and parts[2:3] in (["api"], ["apis"]):
            gv = parts[3:]
            found = openapi.document(self.types, "" if parts[2] == "api" else gv[0], gv[-1]) if gv else None
        else:
            return None
        if found is None:
            raise NotFound.path()
        return found

    @staticmethod
    def _verb(request: kmock.Request, target: Target) -> str:
        method = str(request.method.value)
        if target.subresource is not None and (target.subresource != "status" or not target.type.status_subresource
                                               or method not in ("GET", "PUT", "PATCH")):
            raise NotFound.path()
        if method == "GET":
            if request.params.get("watch") in ("true", "1"):
                return "watch"
            return "get" if target.name else "list"
        verbs = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
        verb = verbs.get(method, "")
        if not verb or (verb == "create") == bool(target.name):
            raise MethodNotAllowed(f"{method} is not supported on this path by the local API")
        return verb

    # --- reads

    @staticmethod
    def _matcher(request: kmock.Request, target: Target) -> selectors.Predicate:
        fields = ",".join(f for f in (request.params.get("fieldSelector"),
                                      f"metadata.name={target.name}" if target.name else None) if f)
        try:
            return selectors.matcher(request.params.get("labelSelector"), fields or None)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    def _objects(self, target: Target, match: selectors.Predicate) -> list[dict[str, Any]]:
        return [o for o in self.store.list(target.type.qualified, target.namespace) if match(o)]

    @staticmethod
    def _wants_table(request: kmock.Request) -> bool:
        accept = _header(request, "Accept")
        return "as=Table" in accept and "g=meta.k8s.io" in accept

    def _list(self, request: kmock.Request, target: Target) -> dict[str, Any]:
        items = self._objects(target, self._matcher(request, target))
        version = str(self.store.revision)
        if self._wants_table(request):
            return tables.table(target.type.columns, items, resource_version=version,
                                include=request.params.get("includeObject", "Metadata"))
        return {"kind": f"{target.type.kind}List", "apiVersion": target.type.api_version,
                "metadata": {"resourceVersion": version}, "items": items}

    def _existing(self, target: Target) -> dict[str, Any]:
        assert target.name is not None
        obj = self.store.get(target.type.qualified, target.namespace, target.name)
        if obj is None:
            raise NotFound.object(target.type.qualified, target.name)
        return obj

    def _get(self, request: kmock.Request, target: Target) -> dict[str, Any]:
        obj = self._existing(target)
        if self._wants_table(request):
            return tables.table(target.type.columns, [obj], resource_version=obj["metadata"]["resourceVersion"],
                                include=request.params.get("includeObject", "Metadata"))
        return obj

    def _watch(self, request: kmock.Request, target: Target) -> AsyncIterator[kmock.Payload]:
        """The event stream: the current objects first when no resourceVersion is given (or with
        ``sendInitialEvents``, closed by a bookmark), then every change after that version."""
        params = request.params
        match = self._matcher(request, target)
        table = self._wants_table(request)
        start = params.get("resourceVersion", "")
        bookmark = params.get("sendInitialEvents") == "true"
        if start in ("", "0") or bookmark:
            since, initial = self.store.revision, self._objects(target, match)
        elif start.isdigit():
            since, initial = int(start), []
        else:
            raise BadRequest(f"invalid resourceVersion {start!r}")
        timeout = float(params.get("timeoutSeconds") or 0) or None
        type_ = target.type

        def shown(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
            if table:
                return {"type": kind, "object": tables.table(type_.columns, [obj],
                                                             resource_version=obj["metadata"]["resourceVersion"])}
            return {"type": kind, "object": obj}

        async def stream() -> AsyncIterator[kmock.Payload]:
            yield b""  # the headers go now: a quiet watch is still a watch
            for obj in initial:
                yield shown("ADDED", obj)
            if bookmark:
                yield {"type": "BOOKMARK", "object": {
                    "kind": type_.kind, "apiVersion": type_.api_version,
                    "metadata": {"resourceVersion": str(since), "annotations": {INITIAL_EVENTS_END: "true"}}}}
            try:
                async with asyncio.timeout(timeout):
                    async for event in self.store.events(type_.qualified, since):
                        obj = event.object
                        if target.namespace in (None, obj["metadata"].get("namespace")) and match(obj):
                            yield shown(event.type, obj)
            except TimeoutError:
                return
            except ApiError as exc:  # Expired: the client lists again
                yield {"type": "ERROR", "object": exc.status()}

        return stream()

    # --- writes

    def _create(self, request: kmock.Request, target: Target) -> kmock.Payload:
        type_ = target.type
        if type_.namespaced and self.store.get(resources.NAMESPACES.qualified, None, target.namespace or "") is None:
            raise NotFound.object("namespaces", target.namespace or "")
        obj, warnings = admission.prepare_create(type_, _json_body(request), target.namespace, now=timestamp(),
                                                 field_validation=request.params.get("fieldValidation", ""))
        name = obj["metadata"]["name"]
        if self.store.get(type_.qualified, target.namespace, name) is not None:
            raise Conflict.exists(type_.qualified, name)
        if request.params.get("dryRun"):
            return _reply(201, obj, warnings)
        return _reply(201, self.store.put(type_.qualified, obj), warnings)

    def _update(self, request: kmock.Request, target: Target, verb: str) -> kmock.Payload:
        type_ = target.type
        if verb == "patch":
            patches.check_media(_header(request, "Content-Type"))
        old = self._existing(target)
        if verb == "update":
            candidate = _json_body(request)
        else:
            candidate = patches.apply(_header(request, "Content-Type"), old, request.body, kind=type_.kind,
                                      group=type_.group, name=old["metadata"]["name"])
        new, warnings = admission.prepare_update(type_, old, candidate, subresource=target.subresource,
                                                 field_validation=request.params.get("fieldValidation", ""))
        if admission.same(new, old) or request.params.get("dryRun"):
            return _reply(200, new, warnings)
        meta = new["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            return _reply(200, self.store.remove(type_.qualified, new), warnings)
        return _reply(200, self.store.put(type_.qualified, new), warnings)

    def _delete(self, request: kmock.Request, target: Target) -> kmock.Payload:
        type_ = target.type
        old = self._existing(target)
        options = _json_body(request) if request.body else {}
        wanted = (options or {}).get("preconditions") or {}
        meta = old["metadata"]
        if any(wanted.get(k) not in (None, meta.get(k)) for k in ("uid", "resourceVersion")):
            raise Conflict.stale(type_.qualified, meta["name"])
        if request.params.get("dryRun"):
            return _reply(200, old)
        if not meta.get("finalizers"):
            return _reply(200, self.store.remove(type_.qualified, old))
        if not meta.get("deletionTimestamp"):
            meta["deletionTimestamp"] = timestamp()
            meta["deletionGracePeriodSeconds"] = 0
            old = self.store.put(type_.qualified, old)
        return _reply(200, old)
