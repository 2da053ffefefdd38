"""Objects in memory with one resourceVersion counter, and the watch events since any version.

A real API server's resourceVersion is what lets a client list, then watch *from that list* without
missing or repeating a change: ``kubectl get -w`` prints each change once, ``kubectl wait`` sees the
condition that turned true between its get and its watch, and kopf's consistency check waits for
the event carrying the version its own patch returned. So every write takes the next version, the
stored object carries it, and its event is kept (the last ``history`` of them) for watches that
start from an earlier version; one older than that gets ``410 Expired``, as from a real server.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from kvshard_local.apiserver.errors import Expired

Key = tuple[str, str | None, str]
"""(resource — ``cacheshards.kvshard.io`` —, namespace or None, name)."""


@dataclasses.dataclass(frozen=True)
class Event:
    """One change: ``ADDED``, ``MODIFIED`` or ``DELETED``, the object after it, its version."""

    revision: int
    type: str
    resource: str
    object: dict[str, Any]


class Store:
    """Every object of every resource, versioned; all methods are called from one event loop."""

    def __init__(self, history: int = 2000) -> None:
        self.revision = 1
        self._objects: dict[Key, dict[str, Any]] = {}
        self._events: list[Event] = []
        self._history = history
        self._forgotten = 0  # the newest revision no longer in _events
        self._changed = asyncio.Event()

    def get(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        found = self._objects.get((resource, namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def list(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Objects of ``resource`` (in ``namespace``; every namespace when None), by namespace and name."""
        keys = sorted((k for k in self._objects if k[0] == resource and (namespace is None or k[1] == namespace)),
                      key=lambda k: (k[1] or "", k[2]))
        return [copy.deepcopy(self._objects[k]) for k in keys]

    def put(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store ``obj`` (created or replaced) under the next version; returns it as stored."""
        key = self._key(resource, obj)
        kind = "MODIFIED" if key in self._objects else "ADDED"
        stored = self._record(resource, kind, obj)
        self._objects[key] = stored
        return copy.deepcopy(stored)

    def remove(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Forget the object; its ``DELETED`` event carries its last state under a new version."""
        self._objects.pop(self._key(resource, obj), None)
        return copy.deepcopy(self._record(resource, "DELETED", obj))

    def events(self, resource: str, since: int) -> AsyncIterator[Event]:
        """Every event of ``resource`` after version ``since``, then each new one as it happens;
        :class:`Expired` at once when events after ``since`` have been forgotten."""
        if since < self._forgotten:
            raise Expired(f"too old resource version: {since} ({self._forgotten + 1})")
        return self._follow(resource, since)

    async def _follow(self, resource: str, since: int) -> AsyncIterator[Event]:
        last = since
        while True:
            if last < self._forgotten:
                raise Expired(f"too old resource version: {last} ({self._forgotten + 1})")
            waiter = self._changed
            start = bisect.bisect_right(self._events, last, key=lambda e: e.revision)
            batch = self._events[start:]
            last = max(last, self.revision)
            for event in batch:
                if event.resource == resource:
                    yield event
            if waiter is self._changed and self.revision == last:
                await waiter.wait()

    @staticmethod
    def _key(resource: str, obj: dict[str, Any]) -> Key:
        meta = obj["metadata"]
        return resource, meta.get("namespace"), meta["name"]

    def _record(self, resource: str, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.revision += 1
        stored = copy.deepcopy(obj)
        stored["metadata"]["resourceVersion"] = str(self.revision)
        self._events.append(Event(self.revision, kind, resource, stored))
        if len(self._events) > 2 * self._history:
            self._forgotten = self._events[-self._history - 1].revision
            del self._events[:-self._history]
        self._changed.set()
        self._changed = asyncio.Event()
        return stored
