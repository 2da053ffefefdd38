"""What the sidecar tells vLLM's connector about a request: which rows come from which stored block.

Why it exists. On the scorer path vLLM does all the math: the sidecar sends the K candidate prompts
``prefix + item + " ["`` of one recommendation as one batched completion, and vLLM's connector loads
from the pod's block store what a causal prefill of those prompts must not compute — each item's
body, prefilled alone (a late scorer's item tokens, all but the last ``interaction``, read only their
item) — and, where vLLM's prefix cache does not hold the whole prefix, the prefix rows it saved when
it computed them. Which rows those are travels *with* the request, as vLLM's ``kv_transfer_params``
(one dict per HTTP request, shared by all its prompts), so nothing per request goes through files:

* ``save`` — ``{digest(prompt): {"key", "tokens"}}``: once the prompt is computed, the connector stores
  its first ``tokens`` rows as block ``key`` (an item prefilled alone, or a prefix);
* ``load`` — the prefix (``key``, ``tokens``: rows ``[0, p)``, optional) and, per item, ``{digest(item
  tokens): {"key", "tokens"}}``: rows ``[p, p + tokens)`` are the item block's first ``tokens`` rows, keys
  RoPE-rotated by ``p``. A prompt is matched to its item by the digest of its tokens between the prefix
  and its last token (the label opening), so the K prompts of one request need no order.

Pure (no vLLM, no torch): the sidecar builds plans, the connector parses them, tests check both.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvshard.segments import is_block_key

PLAN_FIELD = "kvshard"
"""The key of ``kv_transfer_params`` that holds a kvshard plan (other connectors' fields may sit beside it)."""
PLAN_VERSION = 1


class PlanError(ValueError):
    """A ``kv_transfer_params`` plan that is malformed: the connector ignores it and says why."""


def digest(token_ids: Sequence[int]) -> str:
    """A short stable name for a run of token ids (the same in the sidecar and in vLLM's process)."""
    hasher = hashlib.blake2b(b"kvshard-plan-v1", digest_size=12)
    hasher.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return hasher.hexdigest()


@dataclass(frozen=True)
class BlockRows:
    """Rows ``[0, tokens)`` of stored block ``key``."""

    key: str
    tokens: int

    def as_json(self) -> dict[str, Any]:
        return {"key": self.key, "tokens": self.tokens}


@dataclass(frozen=True)
class Piece:
    """Prompt rows ``[start, start + count)`` are rows ``[source, source + count)`` of block ``key``, keys
    rotated by ``shift`` positions."""

    key: str
    start: int
    count: int
    source: int
    shift: int


@dataclass(frozen=True)
class Plan:
    """A parsed plan (see the module docstring)."""

    saves: Mapping[str, BlockRows]
    prefix: BlockRows | None
    prefix_tokens: int
    items: Mapping[str, BlockRows]

    def as_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` that carry this plan."""
        plan: dict[str, Any] = {"v": PLAN_VERSION}
        if self.saves:
            plan["save"] = {name: rows.as_json() for name, rows in self.saves.items()}
        if self.items or self.prefix is not None:
            plan["load"] = {"prefix_tokens": self.prefix_tokens,
                            "prefix": self.prefix.as_json() if self.prefix is not None else None,
                            "items": {name: rows.as_json() for name, rows in self.items.items()}}
        return {PLAN_FIELD: plan}

    def save_for(self, prompt: Sequence[int]) -> BlockRows | None:
        """What to store once ``prompt`` is computed, if anything."""
        return self.saves.get(digest(prompt)) if self.saves else None

    def pieces_for(self, prompt: Sequence[int]) -> list[Piece]:
        """The rows of ``prompt`` the connector can load, in order and contiguous from the first piece's
        start: the prefix's (from 0) when the plan names a prefix block, then the item body's."""
        p = self.prefix_tokens
        if p <= 0 or len(prompt) < p + 2:
            return []
        pieces = []
        if self.prefix is not None:
            pieces.append(Piece(self.prefix.key, 0, p, 0, 0))
        body = self.items.get(digest(prompt[p:-1]))
        if body is not None and body.tokens > 0:
            pieces.append(Piece(body.key, p, min(body.tokens, len(prompt) - 1 - p), 0, p))
        return pieces


def save_plan(saves: Mapping[str, BlockRows]) -> Plan:
    """A plan that stores prompts' rows (``saves``: digest of the whole prompt → block rows)."""
    return Plan(dict(saves), None, 0, {})


def load_plan(prefix_tokens: int, prefix: BlockRows | None, items: Mapping[str, BlockRows]) -> Plan:
    """A plan that loads a prefix of ``prefix_tokens`` rows (from ``prefix`` if given) and item bodies
    (``items``: digest of the item's tokens → its block's body rows)."""
    return Plan({}, prefix, prefix_tokens, dict(items))


def parse_plan(params: Mapping[str, Any] | None) -> Plan | None:
    """The plan in a request's ``kv_transfer_params``; ``None`` when it carries none; :class:`PlanError`
    when it carries a malformed one."""
    if not params or PLAN_FIELD not in params:
        return None
    raw = params[PLAN_FIELD]
    if not isinstance(raw, Mapping) or raw.get("v") != PLAN_VERSION:
        raise PlanError(f"{PLAN_FIELD}: expected an object with \"v\": {PLAN_VERSION}")
    saves = _rows_map(raw.get("save", {}), "save")
    load = raw.get("load")
    if load is None:
        return Plan(saves, None, 0, {})
    if not isinstance(load, Mapping):
        raise PlanError("load: expected an object")
    prefix_tokens = load.get("prefix_tokens")
    if not isinstance(prefix_tokens, int) or isinstance(prefix_tokens, bool) or prefix_tokens < 1:
        raise PlanError("load.prefix_tokens: expected a positive integer")
    prefix = _rows(load["prefix"], "load.prefix") if load.get("prefix") is not None else None
    if prefix is not None and prefix.tokens != prefix_tokens:
        raise PlanError(f"load.prefix holds {prefix.tokens} rows for a prefix of {prefix_tokens} tokens")
    return Plan(saves, prefix, prefix_tokens, _rows_map(load.get("items", {}), "load.items"))


def _rows_map(raw: Any, where: str) -> dict[str, BlockRows]:
    if not isinstance(raw, Mapping):
        raise PlanError(f"{where}: expected an object of digest → block rows")
    return {str(name): _rows(value, f"{where}.{name}") for name, value in raw.items()}


def _rows(raw: Any, where: str) -> BlockRows:
    if not isinstance(raw, Mapping):
        raise PlanError(f"{where}: expected {{\"key\", \"tokens\"}}")
    key, tokens = raw.get("key"), raw.get("tokens")
    if not isinstance(key, str) or not is_block_key(key):
        raise PlanError(f"{where}.key: expected a block key (64 hex characters)")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise PlanError(f"{where}.tokens: expected a non-negative integer")
    return BlockRows(key, tokens)
