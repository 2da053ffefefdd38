"""Kubernetes label-selector matching (``matchLabels`` + ``matchExpressions``), pure.

The operator follows pods through a kopf index of every pod, and decides here which ones belong to
a CacheShard — the same semantics as ``kubectl get pods -l``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class SelectorError(ValueError):
    """A selector that cannot be evaluated (unknown operator, values where none belong)."""


def matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """True when ``labels`` satisfy every term of ``selector``; an empty selector matches nothing
    (the CRD forbids it: selecting every pod in a namespace is never what a user means)."""
    match_labels = selector.get("matchLabels") or {}
    expressions = selector.get("matchExpressions") or []
    if not match_labels and not expressions:
        return False
    if any(labels.get(k) != v for k, v in match_labels.items()):
        return False
    for expr in expressions:
        key, op, values = expr.get("key", ""), expr.get("operator"), list(expr.get("values") or [])
        if op == "In":
            ok = key in labels and labels[key] in values
        elif op == "NotIn":
            ok = key not in labels or labels[key] not in values
        elif op == "Exists":
            ok = key in labels
        elif op == "DoesNotExist":
            ok = key not in labels
        else:
            raise SelectorError(f"unknown selector operator {op!r}")
        if not ok:
            return False
    return True
