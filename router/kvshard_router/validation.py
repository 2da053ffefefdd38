"""Parse just enough of a ``POST /v1/recommend`` body to route it; the sidecar validates the rest.

The router needs the user and the candidate ids (and the history, for the prefix-aware baseline);
everything else in the body (max_tokens, blend options, unknown ids, inline items' texts, limits) is
the sidecar's to judge, and the body is forwarded byte for byte. Ids may be strings or integers, as the sidecar
accepts both. Errors name the JSON field, as the sidecar's do, so a client sees one error format.
"""

from __future__ import annotations

import json
from typing import Any

from kvshard.request_errors import RequestError
from kvshard_router.policies import RouteRequest


def _id(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise RequestError(where, f"must be a string or integer id, got {type(value).__name__}")
    text = str(value)
    if not text:
        raise RequestError(where, "must not be empty")
    return text


def _ids(body: dict[str, Any], name: str, *, required: bool) -> tuple[str, ...]:
    if name not in body:
        if required:
            raise RequestError(name, "is required (a list of item ids)")
        return ()
    value = body[name]
    if not isinstance(value, list):
        raise RequestError(name, f"must be a list of item ids, got {type(value).__name__}")
    return tuple(_id(_inline_id(v, f"{name}[{i}]"), f"{name}[{i}]") for i, v in enumerate(value))


def _inline_id(value: Any, where: str) -> Any:
    """An item the catalog lacks may come inline as ``{"id": ..., "text": ...}``: it routes by its id (the
    sidecar judges the text). An object without both fields is malformed here already."""
    if not isinstance(value, dict):
        return value
    if "id" not in value or "text" not in value:
        raise RequestError(where, 'an inline item needs "id" and "text"')
    return value["id"]


def parse_recommend(raw: bytes, *, history_tokens: int = 0) -> RouteRequest:
    """The routing view of a request body, or :class:`RequestError`."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError("body", f"not valid JSON: {error}") from None
    except RecursionError:
        raise RequestError("body", "JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise RequestError("body", f"must be a JSON object, got {type(body).__name__}")
    if "user_id" not in body:
        raise RequestError("user_id", "is required")
    user = _id(body["user_id"], "user_id")
    candidates = _ids(body, "candidates", required=True)
    history = _ids(body, "history", required=False)
    return RouteRequest(user=user, items=candidates, history=history, history_tokens=history_tokens)
