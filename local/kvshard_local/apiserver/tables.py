"""Server-side tables: what ``kubectl get`` prints, built from printer columns.

kubectl asks for ``application/json;as=Table;v=v1;g=meta.k8s.io`` and prints the rows it gets back;
a server that answers a plain list makes it fail (``Object 'Kind' is missing``) or print names only.
For a custom resource the columns are the CRD's ``additionalPrinterColumns`` (Name first, then each
column's JSONPath, ``date`` columns as an age such as ``3m20s``, missing values as ``<none>``), as
the apiextensions server builds them; built-in kinds get a few columns computed in Python.

Only the JSONPath that printer columns use is understood: ``.a.b``, ``[0]``, ``[*]`` and filters
``[?(@.type=="Ready")]``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

Cell = Callable[[Mapping[str, Any]], Any]

_NAME_DESCRIPTION = ("Name must be unique within a namespace. Is required when creating resources, although some "
                     "resources may allow a client to request the generation of an appropriate name automatically.")
_STEP = re.compile(r"""\.([A-Za-z0-9_-]+)|\[(\d+|\*)\]|\[\?\(@\.([A-Za-z0-9_.-]+)\s*==\s*["']([^"']*)["']\)\]""")


@dataclasses.dataclass(frozen=True)
class Column:
    """One printer column: a JSONPath into the object, or ``cell`` computing the value."""

    name: str
    type: str = "string"
    json_path: str = ""
    cell: Cell | None = None
    priority: int = 0
    description: str = ""
    format: str = ""

    def value(self, obj: Mapping[str, Any], now: datetime.datetime) -> Any:
        raw = self.cell(obj) if self.cell is not None else first(jsonpath(obj, self.json_path))
        return cell_value(self.type, raw, now)

    def definition(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "format": self.format, "description": self.description,
                "priority": self.priority}


def crd_columns(printer_columns: Iterable[Mapping[str, Any]]) -> tuple[Column, ...]:
    """The columns of a CRD version's ``additionalPrinterColumns``."""
    return tuple(Column(name=c["name"], type=c.get("type", "string"), json_path=c["jsonPath"],
                        priority=int(c.get("priority", 0)), description=c.get("description", ""),
                        format=c.get("format", "")) for c in printer_columns)


def jsonpath(obj: Any, path: str) -> list[Any]:
    """Every value ``path`` selects in ``obj`` (empty when nothing matches); ValueError for syntax
    outside the printer-column subset."""
    text = path.strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    nodes = [obj]
    pos = 0
    while pos < len(text):
        step = _STEP.match(text, pos)
        if step is None:
            raise ValueError(f"unsupported JSONPath {path!r} at {text[pos:]!r}")
        key, index, field, wanted = step.groups()
        pos = step.end()
        if key is not None:
            nodes = [n[key] for n in nodes if isinstance(n, Mapping) and key in n]
        elif index == "*":
            nodes = [v for n in nodes if isinstance(n, list) for v in n]
        elif index is not None:
            nodes = [n[int(index)] for n in nodes if isinstance(n, list) and int(index) < len(n)]
        else:
            nodes = [v for n in nodes if isinstance(n, list) for v in n
                     if str(first(jsonpath(v, "." + field))) == wanted]
    return nodes


def first(values: Sequence[Any]) -> Any:
    return values[0] if values else None


def human_duration(seconds: float) -> str:
    """Kubernetes' ``duration.HumanDuration``: ``45s``, ``3m20s``, ``2h5m``, ``3d4h``…"""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d{hours % 24}h" if hours % 24 else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = hours // 24 % 365
        return f"{hours // 24 // 365}y{days}d" if days else f"{hours // 24 // 365}y"
    return f"{hours // 24 // 365}y"


def parse_time(value: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def cell_value(type_: str, value: Any, now: datetime.datetime) -> Any:
    """A JSON value as the column type shows it (None prints as ``<none>``)."""
    if value is None:
        return None
    if type_ == "date":
        try:
            return human_duration((now - parse_time(str(value))).total_seconds())
        except ValueError:
            return "<invalid>"
    if type_ == "integer":
        return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
    if type_ == "number":
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None
    if type_ == "boolean":
        return value if isinstance(value, bool) else None
    if isinstance(value, str):
        return value
    return json.dumps(value)  # kubectl's JSONPath printer shows lists, maps and booleans as JSON


def row(columns: Sequence[Column], obj: Mapping[str, Any], now: datetime.datetime,
        include: str = "Metadata") -> dict[str, Any]:
    """One table row; ``include`` is the request's ``includeObject`` (None, Metadata or Object)."""
    meta = obj.get("metadata") or {}
    out: dict[str, Any] = {"cells": [meta.get("name")] + [c.value(obj, now) for c in columns]}
    if include == "Object":
        out["object"] = dict(obj)
    elif include != "None":
        out["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": dict(meta)}
    return out


def table(columns: Sequence[Column], objects: Iterable[Mapping[str, Any]], *, resource_version: str = "",
          include: str = "Metadata", now: datetime.datetime | None = None) -> dict[str, Any]:
    """A ``meta.k8s.io/v1`` Table of ``objects`` (Name first, then ``columns``)."""
    at = now or datetime.datetime.now(datetime.UTC)
    name = Column("Name", format="name", description=_NAME_DESCRIPTION)
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": [c.definition() for c in (name, *columns)],
            "rows": [row(columns, obj, at, include) for obj in objects]}


# --- columns of the built-in kinds the local cluster serves (what a real server's printers show)

def _pod_ready(pod: Mapping[str, Any]) -> str:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    containers = (pod.get("spec") or {}).get("containers") or []
    return f"{sum(1 for s in statuses if s.get('ready'))}/{len(containers) or len(statuses)}"


def _pod_phase(pod: Mapping[str, Any]) -> Any:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return "Terminating"
    return (pod.get("status") or {}).get("phase")


def _pod_restarts(pod: Mapping[str, Any]) -> int:
    return sum(int(s.get("restartCount", 0)) for s in (pod.get("status") or {}).get("containerStatuses") or [])


def _data_count(obj: Mapping[str, Any]) -> int:
    return len(obj.get("data") or {}) + len(obj.get("binaryData") or {})


def _event_object(event: Mapping[str, Any]) -> str:
    involved = event.get("involvedObject") or {}
    return f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}"


def _event_last_seen(event: Mapping[str, Any]) -> Any:
    meta = event.get("metadata") or {}
    return event.get("lastTimestamp") or event.get("eventTime") or meta.get("creationTimestamp")


AGE = Column("Age", type="date", json_path=".metadata.creationTimestamp")
POD_COLUMNS = (Column("Ready", cell=_pod_ready), Column("Status", cell=_pod_phase),
               Column("Restarts", type="integer", cell=_pod_restarts), AGE,
               Column("IP", json_path=".status.podIP", priority=1), Column("Node", json_path=".spec.nodeName",
                                                                          priority=1))
CONFIGMAP_COLUMNS = (Column("Data", type="integer", cell=_data_count), AGE)
SECRET_COLUMNS = (Column("Type", json_path=".type"), Column("Data", type="integer", cell=_data_count), AGE)
NAMESPACE_COLUMNS = (Column("Status", json_path=".status.phase"), AGE)
EVENT_COLUMNS = (Column("Last Seen", type="date", cell=_event_last_seen), Column("Type", json_path=".type"),
                 Column("Reason", json_path=".reason"), Column("Object", cell=_event_object),
                 Column("Message", json_path=".message"))
