"""``labelSelector`` and ``fieldSelector`` query parameters as predicates over objects.

kubectl sends them more often than one would think: ``kubectl wait`` and ``kubectl delete`` watch
``fieldSelector=metadata.name=<name>``, ``kubectl describe`` lists the object's events with
``involvedObject.name=…,involvedObject.uid=…``, and ``-l`` is a label selector. Field selectors are
answered for any dotted path (a real server allows a few per kind); a value is compared as text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Predicate = Callable[[Mapping[str, Any]], bool]

_SET = re.compile(r"^\s*(!?)([^\s!=,()]+)\s*(?:(in|notin)\s*\(([^)]*)\))?\s*$")
_EQUALITY = re.compile(r"^\s*([^\s!=,()]+)\s*(==|=|!=)\s*([^\s,]*)\s*$")


def _split(text: str) -> list[str]:
    """Split on commas outside parentheses (``a in (x,y),b`` is two requirements)."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p for p in parts if p.strip()]


def _label_check(key: str, op: str, values: frozenset[str]) -> Callable[[Mapping[str, str]], bool]:
    def check(labels: Mapping[str, str]) -> bool:
        if op == "exists":
            return key in labels
        if op == "!exists":
            return key not in labels
        if op in ("=", "==", "in"):
            return labels.get(key) in values
        return labels.get(key) not in values  # != and notin

    return check


def label_selector(text: str) -> Callable[[Mapping[str, str]], bool]:
    """A predicate over a label map; ValueError for a selector it cannot parse."""
    checks: list[Callable[[Mapping[str, str]], bool]] = []
    for part in _split(text):
        equality = _EQUALITY.match(part)
        found = _SET.match(part)
        if equality:
            key, op, value = equality.groups()
            checks.append(_label_check(key, op, frozenset({value})))
        elif found and not (found.group(1) and found.group(3)):
            negated, key, op, values = found.groups()
            if op is None:
                checks.append(_label_check(key, "!exists" if negated else "exists", frozenset()))
            else:
                checks.append(_label_check(key, op, frozenset(v.strip() for v in values.split(",") if v.strip())))
        else:
            raise ValueError(f"unable to parse requirement: {part.strip()!r}")
    return lambda labels: all(check(labels) for check in checks)


def _field(obj: Mapping[str, Any], path: str) -> str:
    node: Any = obj
    for key in path.split("."):
        node = node.get(key) if isinstance(node, Mapping) else None
    if node is None:
        return ""
    return str(node).lower() if isinstance(node, bool) else str(node)


def _field_check(path: str, op: str, value: str) -> Predicate:
    def check(obj: Mapping[str, Any]) -> bool:
        return (_field(obj, path) == value) != (op == "!=")

    return check


def field_selector(text: str) -> Predicate:
    """A predicate over a whole object; ValueError for a selector it cannot parse."""
    checks: list[Predicate] = []
    for part in _split(text):
        found = _EQUALITY.match(part)
        if not found:
            raise ValueError(f"invalid field selector: {part.strip()!r}")
        checks.append(_field_check(*found.groups()))
    return lambda obj: all(check(obj) for check in checks)


def matcher(labels: str | None, fields: str | None) -> Predicate:
    """Both selectors of a request at once (either may be absent)."""
    by_labels = label_selector(labels) if labels else None
    by_fields = field_selector(fields) if fields else None

    def match(obj: Mapping[str, Any]) -> bool:
        if by_labels is not None and not by_labels((obj.get("metadata") or {}).get("labels") or {}):
            return False
        return by_fields is None or by_fields(obj)

    return match
