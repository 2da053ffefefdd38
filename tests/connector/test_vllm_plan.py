"""The plan the sidecar hands vLLM's connector: which prompt rows come from which stored block.

A plan travels as ``kv_transfer_params`` with a batched completion of K candidate prompts, so each
prompt must find its own rows by its tokens alone, a malformed plan must be refused with a reason
(the connector then loads nothing), and nothing may be claimed that is not contiguous from where
vLLM's own prefix cache stops.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvshard_sidecar.vllm.plan import (
    PLAN_FIELD,
    BlockRows,
    Piece,
    PlanError,
    digest,
    load_plan,
    parse_plan,
    save_plan,
)

PREFIX_KEY, ITEM_A, ITEM_B = "a" * 64, "b" * 64, "c" * 64
PREFIX = list(range(100, 110))  # 10 tokens
ITEM_TOKENS = {ITEM_A: [7, 8, 9, 10, 11, 12], ITEM_B: [20, 21, 22]}
OPENING = 5


def _plan(with_prefix: bool = True) -> Any:
    items = {digest(tokens): BlockRows(key, len(tokens) - 2) for key, tokens in ITEM_TOKENS.items()}
    return load_plan(len(PREFIX), BlockRows(PREFIX_KEY, len(PREFIX)) if with_prefix else None, items)


def test_a_plan_survives_the_trip_through_kv_transfer_params() -> None:
    plan = _plan()
    params = plan.as_params()
    assert set(params) == {PLAN_FIELD}
    assert parse_plan(params) == plan
    saves = save_plan({digest(PREFIX): BlockRows(PREFIX_KEY, len(PREFIX))})
    assert parse_plan(saves.as_params()) == saves


def test_each_candidate_prompt_finds_its_own_item_body_behind_the_prefix() -> None:
    plan = _plan()
    for key, tokens in ITEM_TOKENS.items():
        prompt = [*PREFIX, *tokens, OPENING]
        assert plan.pieces_for(prompt) == [
            Piece(PREFIX_KEY, 0, len(PREFIX), 0, 0),  # the prefix, where it stands
            Piece(key, len(PREFIX), len(tokens) - 2, 0, len(PREFIX)),  # the body, rotated by the prefix's length
        ]


def test_an_item_the_plan_does_not_name_loads_only_the_prefix() -> None:
    assert _plan().pieces_for([*PREFIX, 1, 2, 3, OPENING]) == [Piece(PREFIX_KEY, 0, len(PREFIX), 0, 0)]


def test_without_a_prefix_block_the_body_is_loaded_only_after_the_prefix() -> None:
    pieces = _plan(with_prefix=False).pieces_for([*PREFIX, *ITEM_TOKENS[ITEM_A], OPENING])
    assert pieces == [Piece(ITEM_A, len(PREFIX), 4, 0, len(PREFIX))]


def test_the_label_opening_is_never_loaded() -> None:
    """vLLM must compute at least the last token (it returns the score there)."""
    plan = load_plan(len(PREFIX), None, {digest([7, 8]): BlockRows(ITEM_A, 99)})
    (piece,) = plan.pieces_for([*PREFIX, 7, 8, OPENING])
    assert piece.start + piece.count == len(PREFIX) + 2


def test_a_save_is_found_by_the_whole_prompt() -> None:
    plan = save_plan({digest(ITEM_TOKENS[ITEM_A]): BlockRows(ITEM_A, 6)})
    assert plan.save_for(ITEM_TOKENS[ITEM_A]) == BlockRows(ITEM_A, 6)
    assert plan.save_for(ITEM_TOKENS[ITEM_B]) is None


def test_requests_without_a_plan_carry_none() -> None:
    assert parse_plan(None) is None
    assert parse_plan({}) is None
    assert parse_plan({"do_remote_prefill": True}) is None  # another connector's field


@pytest.mark.parametrize("raw,why", [
    ({"v": 2}, "expected an object"),
    ("plan", "expected an object"),
    ({"v": 1, "save": {"x": {"key": "not-a-key", "tokens": 3}}}, "block key"),
    ({"v": 1, "save": {"x": {"key": "a" * 64, "tokens": -1}}}, "non-negative"),
    ({"v": 1, "save": {"x": {"key": "a" * 64, "tokens": True}}}, "non-negative"),
    ({"v": 1, "load": {"prefix_tokens": 0, "items": {}}}, "positive integer"),
    ({"v": 1, "load": {"prefix_tokens": 5, "prefix": {"key": "a" * 64, "tokens": 4}}}, "rows for a prefix"),
    ({"v": 1, "load": {"prefix_tokens": 5, "items": []}}, "expected an object"),
])
def test_a_malformed_plan_is_refused_with_the_reason(raw: Any, why: str) -> None:
    with pytest.raises(PlanError, match=why):
        parse_plan({PLAN_FIELD: raw})


def test_digests_are_stable_and_tell_token_runs_apart() -> None:
    assert digest([1, 2, 3]) == digest((1, 2, 3))
    assert digest([1, 2, 3]) != digest([1, 2, 4])
    assert digest([1, 2]) != digest([1, 2, 0])
