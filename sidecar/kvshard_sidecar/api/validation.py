"""Request validation for the sidecar API: pure functions, one error per request, naming the field.

Everything a client can get wrong is caught here, before any tensor is touched, so a malformed
request costs microseconds and can never take the model thread down. Errors carry the HTTP status
and the JSON path of the offending field (``candidates[3]``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvshard.catalog_schema import parse_record
from kvshard.datasets import Item
from kvshard.request_errors import RequestError
from kvshard_sidecar.engine.methods import METHODS, method_settings
from kvshard_sidecar.engine.settings import SELECTORS, BlendSettings, SettingsError
from kvshard_sidecar.serving.calls import Limits, PrefillCall, RecommendCall

MAX_ID_LENGTH = 256
MAX_INSTRUCTION_LENGTH = 2000
BLEND_FIELDS = {"method", "selector", "ratio", "check_layers", "schedule", "boundary_w", "deviation_on",
                "recompute_free", "epic_k"}
RECOMMEND_FIELDS = {"user_id", "history", "candidates", "instruction", "mode", "top_k", "max_tokens", "temperature",
                    "blend", "logprobs", "retrieval_scores", "retrieval_weight"}
MAX_RETRIEVAL_WEIGHT = 100.0
MODES = ("rank", "generate")
# Decoding options and their defaults: rank mode accepts a field only at its default.
GENERATE_DEFAULTS: dict[str, float] = {"max_tokens": 1, "temperature": 0.0, "logprobs": 0}
MAX_LOGPROBS = 20


def _object(body: Any, allowed: set[str], where: str = "body") -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(where, "must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        name = unknown[0] if unknown[0].isidentifier() else json.dumps(unknown[0])
        raise RequestError(name if where == "body" else f"{where}.{name}",
                           f"unknown field (allowed: {', '.join(sorted(allowed))})")
    return body


def _identifier(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RequestError(where, f"must be a string or integer id, got {type(value).__name__}")
    text = str(value)
    if not text or len(text) > MAX_ID_LENGTH:
        raise RequestError(where, f"must be 1–{MAX_ID_LENGTH} characters")
    return text


def _item_ids(value: Any, where: str, known: Mapping[str, object], limit: int, *, allow_empty: bool,
              unique: bool, inline: dict[str, Item] | None = None) -> tuple[str, ...]:
    """Item ids; with ``inline`` an entry may also be an object ``{"id", "text", ...}`` (a cold item):
    its text is used when the catalog lacks the id, and collected into ``inline``."""
    if not isinstance(value, list):
        raise RequestError(where, f"must be a list of item ids, got {type(value).__name__}")
    if not value and not allow_empty:
        raise RequestError(where, "must not be empty")
    if len(value) > limit:
        raise RequestError(where, f"has {len(value)} entries; at most {limit} are allowed")
    ids: list[str] = []
    for i, entry in enumerate(value):
        if inline is not None and isinstance(entry, dict):
            parsed = parse_record(entry)
            if isinstance(parsed, str):
                raise RequestError(f"{where}[{i}]", parsed)
            item_id, text, fields = parsed
            if item_id not in known:
                inline.setdefault(item_id, Item(item_id, text, fields))
            ids.append(item_id)
        else:
            ids.append(_identifier(entry, f"{where}[{i}]"))
    unknown = [(i, item) for i, item in enumerate(ids) if item not in known and item not in (inline or {})]
    if unknown:
        i, item = unknown[0]
        names = ", ".join(repr(u) for _, u in unknown[:10]) + (" …" if len(unknown) > 10 else "")
        hint = ' (give {"id": ..., "text": ...} to serve an item the catalog lacks)' if inline is not None else ""
        raise RequestError(f"{where}[{i}]", f"unknown item id {item!r}; unknown: {names}{hint}", status=422)
    if unique and len(set(ids)) != len(ids):
        seen: set[str] = set()
        for i, item in enumerate(ids):
            if item in seen:
                raise RequestError(f"{where}[{i}]", f"duplicate item id {item!r}")
            seen.add(item)
    return tuple(ids)


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float,
            integer: bool = False, where: str = "") -> float:
    value = body.get(name, default)
    name = f"{where}{name}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise RequestError(name, f"must be {kind}, got {type(value).__name__}")
    if not math.isfinite(value) or not low <= value <= high:
        raise RequestError(name, f"must be between {low:g} and {high:g}, got {value}")
    return value


def parse_blend(value: Any, defaults: BlendSettings, num_layers: int | None = None) -> BlendSettings:
    """Apply a request's ``blend`` object to the sidecar's default blend settings (checked against the
    model's ``num_layers`` when known, so no setting fails later inside the engine)."""
    if value is None:
        return defaults
    blend = _object(value, BLEND_FIELDS, "blend")
    changes: dict[str, Any] = {}
    if "method" in blend:
        defaults = _method(blend, defaults)
    if "selector" in blend:
        if blend["selector"] not in SELECTORS:
            raise RequestError("blend.selector", f"must be one of {', '.join(SELECTORS)}")
        changes["selector"] = blend["selector"]
    if "ratio" in blend and "method" not in blend:  # a method applies its ratio itself
        if "selector" not in blend and defaults.selector == "none":
            # silently ignored it would look like a recompute that never happened (e.g. "ratio": 1 taken
            # for full prefill while a late scorer's CacheShard serves method none)
            raise RequestError("blend.ratio", "the blend in force recomputes nothing (method none), so a ratio "
                               "alone changes nothing: name a method with it, e.g. {\"method\": \"tail\", "
                               "\"ratio\": 0.3}, or {\"method\": \"full\"} for full prefill")
        changes["ratio"] = float(_number(blend, "ratio", 0.0, 0.0, 1.0, where="blend."))
    if "deviation_on" in blend:
        if blend["deviation_on"] not in ("k", "v", "kv"):
            raise RequestError("blend.deviation_on", "must be 'k', 'v' or 'kv'")
        changes["deviation_on"] = blend["deviation_on"]
    if "boundary_w" in blend:
        changes["boundary_w"] = int(_number(blend, "boundary_w", 0, 0, 4096, integer=True, where="blend."))
    if "epic_k" in blend:
        changes["epic_k"] = int(_number(blend, "epic_k", 0, 0, 4096, integer=True, where="blend."))
    if "recompute_free" in blend:
        if not isinstance(blend["recompute_free"], bool):
            raise RequestError("blend.recompute_free", "must be true or false")
        changes["recompute_free"] = blend["recompute_free"]
    for name, kind in (("check_layers", int), ("schedule", float)):
        if name in blend:
            items = blend[name]
            if not isinstance(items, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
                for v in items
            ) or len(items) > 64:
                raise RequestError(f"blend.{name}", f"must be a list of at most 64 {kind.__name__}s")
            changes[name] = tuple(kind(v) for v in items)
    if "ratio" in changes and "schedule" not in changes and defaults.schedule:
        changes["schedule"] = ()  # a new ratio invalidates the default schedule's last step
    try:
        settings = defaults.with_(**changes)
    except (SettingsError, TypeError) as error:
        raise RequestError("blend", str(error)) from None
    layers = settings.check_layers
    if num_layers is not None and layers and layers[-1] >= num_layers:
        raise RequestError("blend.check_layers", f"check layer {layers[-1]} is beyond the model's {num_layers} "
                           f"layers (0–{num_layers - 1})")
    return settings


def _method(blend: Mapping[str, Any], defaults: BlendSettings) -> BlendSettings:
    """A named method (``cacheblend``, ``epic``, ``deviation+structure`` …) as the request's starting point;
    ``selector`` cannot be given beside it (the method names one), ``ratio`` applies on top."""
    spec = blend["method"]
    if "selector" in blend:
        raise RequestError("blend.method", "give either method or selector, not both")
    names = spec.split("+") if isinstance(spec, str) else []
    if not names or names[0] not in METHODS:
        raise RequestError("blend.method", f"must be one of {', '.join(METHODS)}, optionally with +tail, "
                           "+structure or +segment")
    if "ape" in names[1:]:
        raise RequestError("blend.method", "+ape needs the model's attention calibration, which this sidecar "
                           "does not load")
    ratio = float(_number(blend, "ratio", defaults.ratio, 0.0, 1.0, where="blend."))
    try:
        return method_settings(spec, ratio, defaults.with_(schedule=()))
    except (ValueError, TypeError) as error:
        raise RequestError("blend.method", str(error)) from None


def parse_recommend(body: Any, items: Mapping[str, object], limits: Limits,
                    blend_defaults: BlendSettings | None = None) -> RecommendCall:
    """Validate a ``POST /v1/recommend`` body against the catalog ``items``."""
    request = _object(body, RECOMMEND_FIELDS)
    for required in ("user_id", "candidates"):
        if required not in request:
            raise RequestError(required, "is required")
    instruction = request.get("instruction")
    if instruction is not None and (not isinstance(instruction, str) or not instruction.strip()
                                    or len(instruction) > MAX_INSTRUCTION_LENGTH):
        raise RequestError("instruction", f"must be a non-empty string of at most {MAX_INSTRUCTION_LENGTH} characters")
    mode = request.get("mode", "rank")
    if mode not in MODES:
        raise RequestError("mode", f"must be one of {', '.join(map(repr, MODES))}")
    blend = parse_blend(request.get("blend"), blend_defaults or BlendSettings(), limits.num_layers)
    inline: dict[str, Item] = {}
    candidates = _item_ids(request["candidates"], "candidates", items, limits.max_candidates,
                           allow_empty=False, unique=True, inline=inline)
    max_tokens = int(_number(request, "max_tokens", 1, 1, limits.max_new_tokens, integer=True))
    temperature = float(_number(request, "temperature", 0.0, 0.0, 2.0))
    logprobs = int(_number(request, "logprobs", 0, 0, MAX_LOGPROBS, integer=True))
    top_k = None
    if mode == "rank":
        # Ranking reads one position's label log-probabilities: decoding options would be ignored,
        # so asking for anything but their defaults is a mistake worth naming.
        decoding = {"max_tokens": max_tokens, "temperature": temperature, "logprobs": logprobs}
        for name, value in decoding.items():
            if value != GENERATE_DEFAULTS[name]:
                raise RequestError(name, "applies to \"mode\": \"generate\" only; \"rank\" (the default) "
                                   "scores every candidate at the answer position")
        if "top_k" in request:
            top_k = int(_number(request, "top_k", 0, 1, limits.max_candidates, integer=True))
    elif "top_k" in request:
        raise RequestError("top_k", "applies to \"mode\": \"rank\" only")
    retrieval_scores, retrieval_weight = _retrieval(request, len(candidates), mode)
    return RecommendCall(
        user_id=_identifier(request["user_id"], "user_id"),
        history=_item_ids(request.get("history", []), "history", items, limits.max_history,
                          allow_empty=True, unique=False, inline=inline),
        candidates=candidates,
        instruction=instruction,
        mode=mode,
        top_k=top_k,
        max_tokens=max_tokens,
        temperature=temperature,
        blend=blend,
        logprobs=logprobs,
        inline=inline,
        retrieval_scores=retrieval_scores,
        retrieval_weight=retrieval_weight,
    )


def _retrieval(request: Mapping[str, Any], candidates: int,
               mode: str) -> tuple[tuple[float, ...] | None, float | None]:
    """``retrieval_scores`` (the retrieval stage's score of each candidate, in the candidates' order) and
    ``retrieval_weight`` (its weight in the fused ranking; ``None`` when the request leaves it to the model's
    recorded weight), both for ``"mode": "rank"``."""
    if "retrieval_scores" not in request:
        if "retrieval_weight" in request:
            raise RequestError("retrieval_weight", "needs retrieval_scores (the weight is theirs)")
        return None, None
    if mode != "rank":
        raise RequestError("retrieval_scores", "applies to \"mode\": \"rank\" only (they reorder the ranking)")
    scores = request["retrieval_scores"]
    if not isinstance(scores, list) or len(scores) != candidates:
        raise RequestError("retrieval_scores", f"must be a list of {candidates} numbers, one per candidate in "
                           "their order")
    for i, value in enumerate(scores):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RequestError(f"retrieval_scores[{i}]", f"must be a finite number, got {value!r}")
    weight = (float(_number(request, "retrieval_weight", 1.0, 0.0, MAX_RETRIEVAL_WEIGHT))
              if "retrieval_weight" in request else None)
    return tuple(float(v) for v in scores), weight


def parse_prefill(body: Any, items: Mapping[str, object], users: Sequence[str] | Mapping[str, object],
                  limit: int = 100_000) -> PrefillCall:
    """Validate a ``POST /v1/blocks/prefill`` body: ``{"items": [...], "users": [...]}``."""
    request = _object(body, {"items", "users"})
    if "items" not in request and "users" not in request:
        raise RequestError("items", "give items and/or users to prefill")
    item_ids = _item_ids(request.get("items", []), "items", items, limit, allow_empty=True, unique=False)
    raw_users = request.get("users", [])
    if not isinstance(raw_users, list) or len(raw_users) > limit:
        raise RequestError("users", f"must be a list of at most {limit} user ids")
    user_ids = tuple(_identifier(u, f"users[{i}]") for i, u in enumerate(raw_users))
    for i, user in enumerate(user_ids):
        if user not in users:
            raise RequestError(f"users[{i}]", f"unknown user id {user!r}", status=422)
    return PrefillCall(items=tuple(dict.fromkeys(item_ids)), users=tuple(dict.fromkeys(user_ids)))
