"""Status conditions as a list-map keyed by ``type`` (Kubernetes API conventions).

Pure functions over plain lists of dicts, so handlers stay thin and tests need no cluster.
``lastTransitionTime`` changes only when ``status`` changes; reason and message may change freely.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

READY = "Ready"
"""The current spec is placed and published to etcd (routers and sidecars follow it); not that it is warm."""
PLACED = "Placed"
REBALANCING = "Rebalancing"
DEGRADED = "Degraded"
WARM = "Warm"
"""Every cluster of the current placement generation has a warm replica: requests are served from cache."""
TYPES = (READY, PLACED, WARM, REBALANCING, DEGRADED)

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"

Condition = dict[str, Any]


def now() -> str:
    """RFC 3339 UTC timestamp with seconds precision, as Kubernetes writes it."""
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def get(conditions: Sequence[Mapping[str, Any]] | None, type_: str) -> Condition | None:
    """The condition of ``type_``, or None."""
    for condition in conditions or ():
        if condition.get("type") == type_:
            return dict(condition)
    return None


def is_true(conditions: Sequence[Mapping[str, Any]] | None, type_: str) -> bool:
    found = get(conditions, type_)
    return bool(found and found.get("status") == TRUE)


def set_condition(
    conditions: Sequence[Mapping[str, Any]] | None,
    type_: str,
    status: str,
    reason: str,
    message: str = "",
    *,
    observed_generation: int | None = None,
    at: str | None = None,
) -> list[Condition]:
    """A new list with ``type_`` set; order kept, new types appended."""
    if status not in (TRUE, FALSE, UNKNOWN):
        raise ValueError(f"condition status must be True/False/Unknown, not {status!r}")
    if not reason or not reason[0].isupper() or not reason.isalnum():
        raise ValueError(f"condition reason must be one CamelCase word, not {reason!r}")
    out: list[Condition] = []
    found = False
    for old in conditions or ():
        if old.get("type") != type_:
            out.append(dict(old))
            continue
        found = True
        changed = old.get("status") != status
        out.append(_make(type_, status, reason, message, observed_generation,
                         (at or now()) if changed else old.get("lastTransitionTime") or at or now()))
    if not found:
        out.append(_make(type_, status, reason, message, observed_generation, at or now()))
    return out


def _make(type_: str, status: str, reason: str, message: str, generation: int | None, at: str) -> Condition:
    condition: Condition = {"type": type_, "status": status, "reason": reason, "message": message,
                            "lastTransitionTime": at}
    if generation is not None:
        condition["observedGeneration"] = generation
    return condition


def ensure_all(
    conditions: Sequence[Mapping[str, Any]] | None, *, observed_generation: int | None = None, at: str | None = None
) -> list[Condition]:
    """Every known type present (missing ones as ``Unknown``/``Pending``): written on first sight."""
    out = [dict(c) for c in conditions or ()]
    for type_ in TYPES:
        if get(out, type_) is None:
            out = set_condition(out, type_, UNKNOWN, "Pending", "not reconciled yet",
                                observed_generation=observed_generation, at=at)
    return out


def merge_status(body: MutableMapping[str, Any], fields: Mapping[str, Any], owned: Sequence[str],
                 *, observed_generation: int | None = None) -> None:
    """Write a timer's ``fields`` into the *freshest* ``body`` (a kopf patch function), taking from
    ``fields["conditions"]`` only the condition types the timer ``owned``.

    Why: a timer's ``status`` may predate a handler's patch that just landed (the rebalance timer
    started while the first placement was being published). Writing its whole conditions list would
    put back the ``Ready=Unknown`` it read; merging only its own types into the current list keeps
    what the handler wrote.
    """
    status = body.setdefault("status", {})
    for key, value in fields.items():
        if key != "conditions":
            status[key] = value
    conditions = ensure_all(status.get("conditions"), observed_generation=observed_generation)
    for type_ in owned:
        mine = get(fields.get("conditions"), type_)
        if mine is not None:
            conditions = set_condition(conditions, type_, mine["status"], mine["reason"], mine.get("message", ""),
                                       observed_generation=observed_generation)
    status["conditions"] = conditions
