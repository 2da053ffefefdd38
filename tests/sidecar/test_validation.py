"""Request validation: every client mistake is a 4xx whose message names the field."""

from __future__ import annotations

from typing import Any

import pytest

from kvshard.request_errors import RequestError
from kvshard_sidecar.api.validation import Limits, parse_blend, parse_prefill, parse_recommend
from kvshard_sidecar.engine.settings import BlendSettings

ITEMS = {str(i): object() for i in range(1, 50)}
LIMITS = Limits(max_candidates=10, max_history=20, max_new_tokens=16)
VALID = {"user_id": "7", "history": ["1", "2"], "candidates": ["3", "4", "5"]}


def reject(body: Any) -> RequestError:
    with pytest.raises(RequestError) as error:
        parse_recommend(body, ITEMS, LIMITS)
    assert 400 <= error.value.status < 500
    return error.value


def test_a_valid_request_parses_with_defaults() -> None:
    call = parse_recommend(VALID, ITEMS, LIMITS)
    assert call.user_id == "7" and call.candidates == ("3", "4", "5")
    assert call.max_tokens == 1 and call.temperature == 0.0 and call.instruction is None
    assert call.mode == "rank" and call.top_k is None


def test_rank_mode_accepts_decoding_fields_only_at_their_defaults() -> None:
    call = parse_recommend({**VALID, "max_tokens": 1, "temperature": 0, "logprobs": 0, "top_k": 2}, ITEMS, LIMITS)
    assert (call.mode, call.top_k) == ("rank", 2)
    for field, value in (("max_tokens", 2), ("temperature", 0.7), ("logprobs", 5)):
        assert "generate" in reject({**VALID, field: value}).message


def test_a_check_layer_beyond_the_model_is_a_400_naming_the_field() -> None:
    body = {**VALID, "blend": {"selector": "deviation", "check_layers": [1, 30]}}
    with pytest.raises(RequestError) as error:
        parse_recommend(body, ITEMS, Limits(max_candidates=10, num_layers=30))
    assert (error.value.status, error.value.field) == (400, "blend.check_layers")
    assert "30 layers" in error.value.message
    ok = parse_recommend({**VALID, "blend": {"selector": "deviation", "check_layers": [1, 29]}}, ITEMS,
                         Limits(max_candidates=10, num_layers=30))
    assert ok.blend.check_layers == (1, 29)


def test_generate_mode_takes_decoding_fields() -> None:
    call = parse_recommend({**VALID, "mode": "generate", "max_tokens": 4, "temperature": 0.5, "logprobs": 3},
                           ITEMS, LIMITS)
    assert (call.mode, call.max_tokens, call.temperature, call.logprobs) == ("generate", 4, 0.5, 3)


def test_integer_ids_are_accepted_as_strings() -> None:
    call = parse_recommend({"user_id": 7, "candidates": [3, 4]}, ITEMS, LIMITS)
    assert call.user_id == "7" and call.candidates == ("3", "4") and call.history == ()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"candidates": []}, "candidates"),
        ({"candidates": "3,4"}, "candidates"),
        ({"candidates": ["3", "3"]}, "candidates[1]"),
        ({"candidates": ["3", "999"]}, "candidates[1]"),
        ({"candidates": [str(i) for i in range(1, 12)]}, "candidates"),
        ({"candidates": ["3", 4.5]}, "candidates[1]"),
        ({"candidates": ["3", None]}, "candidates[1]"),
        ({"history": ["1", "nope"]}, "history[1]"),
        ({"history": {"a": 1}}, "history"),
        ({"history": ["1"] * 21}, "history"),
        ({"user_id": ""}, "user_id"),
        ({"user_id": ["x"]}, "user_id"),
        ({"user_id": True}, "user_id"),
        ({"user_id": "x" * 300}, "user_id"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 17}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": "4"}, "max_tokens"),
        ({"mode": "generate", "max_tokens": 17}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"mode": "best"}, "mode"),
        ({"mode": ["rank"]}, "mode"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 11}, "top_k"),
        ({"top_k": "2"}, "top_k"),
        ({"mode": "generate", "top_k": 2}, "top_k"),
        ({"instruction": ""}, "instruction"),
        ({"instruction": 5}, "instruction"),
        ({"blend": []}, "blend"),
        ({"blend": {"selector": "magic"}}, "blend.selector"),
        ({"blend": {"ratio": 1.5}}, "blend.ratio"),
        ({"blend": {"unknown": 1}}, "blend.unknown"),
        ({"blend": {"check_layers": ["1"]}}, "blend.check_layers"),
        ({"blend": {"check_layers": [0]}}, "blend"),
        ({"blend": {"method": "magic"}}, "blend.method"),
        ({"blend": {"method": 3}}, "blend.method"),
        ({"blend": {"method": "epic", "selector": "none"}}, "blend.method"),
        ({"blend": {"method": "none+ape"}}, "blend.method"),
        ({"blend": {"method": "none+structure"}}, "blend.method"),
        ({"blend": {"method": "epic", "epic_k": -1}}, "blend.epic_k"),
        ({"extra": 1}, "extra"),
    ],
)
def test_mistakes_name_their_field(change: dict[str, Any], field: str) -> None:
    error = reject({**VALID, **change})
    assert error.field == field, error.message


@pytest.mark.parametrize("missing", ["user_id", "candidates"])
def test_required_fields(missing: str) -> None:
    body = dict(VALID)
    del body[missing]
    assert reject(body).field == missing


@pytest.mark.parametrize("body", [None, [], "text", 3, True])
def test_the_body_must_be_an_object(body: Any) -> None:
    assert reject(body).field == "body"


def test_unknown_items_are_422() -> None:
    assert reject({**VALID, "candidates": ["404"]}).status == 422


def test_blend_overrides_apply_over_defaults() -> None:
    defaults = BlendSettings()
    blended = parse_blend({"selector": "boundary", "ratio": 0.3}, defaults)
    assert blended.selector == "boundary" and blended.ratio == 0.3
    assert parse_blend(None, defaults) is defaults


def test_a_ratio_alone_under_method_none_is_refused_not_silently_ignored() -> None:
    from kvshard_sidecar.engine.methods import method_settings

    serving_none = method_settings("none", 0.0, BlendSettings())  # a late scorer's CacheShard
    with pytest.raises(RequestError, match="full") as refused:
        parse_blend({"ratio": 1.0}, serving_none)
    assert refused.value.field == "blend.ratio"
    assert parse_blend({"method": "full"}, serving_none).ratio == 1.0
    assert parse_blend({"selector": "tail", "ratio": 0.3}, serving_none).ratio == 0.3


def test_a_named_method_is_the_benchmarks_settings_at_the_requested_ratio() -> None:
    from kvshard_sidecar.engine.methods import method_settings

    defaults = BlendSettings()
    assert parse_blend({"method": "cacheblend", "ratio": 0.2}, defaults) == method_settings("cacheblend", 0.2, defaults)
    epic = parse_blend({"method": "epic", "epic_k": 4}, defaults)
    assert (epic.selector, epic.epic_k, epic.prefill_context, epic.ratio) == ("epic", 4, "standalone", defaults.ratio)
    full = parse_blend({"method": "full"}, defaults)
    assert (full.ratio, full.selector) == (1.0, "tail")
    corrected = parse_blend({"method": "deviation+structure"}, defaults)
    assert corrected.structure and corrected.selector == "deviation"


def test_prefill_needs_known_items_or_users() -> None:
    call = parse_prefill({"items": ["1", "2", "1"], "users": ["u1"]}, ITEMS, {"u1": []})
    assert call.items == ("1", "2") and call.users == ("u1",)
    for body, field in [({}, "items"), ({"items": ["x"]}, "items[0]"), ({"users": ["u9"]}, "users[0]"),
                        ({"users": "u1"}, "users")]:
        with pytest.raises(RequestError) as error:
            parse_prefill(body, ITEMS, {"u1": []})
        assert error.value.field == field


def test_retrieval_scores_are_one_finite_number_per_candidate_in_rank_mode() -> None:
    call = parse_recommend({**VALID, "retrieval_scores": [0.5, 2, 0.0]}, ITEMS, LIMITS)
    assert (call.retrieval_scores, call.retrieval_weight) == ((0.5, 2.0, 0.0), None)  # None: the model's own
    assert parse_recommend({**VALID, "retrieval_scores": [1, 2, 3], "retrieval_weight": 0.5},
                           ITEMS, LIMITS).retrieval_weight == 0.5
    assert parse_recommend(VALID, ITEMS, LIMITS).retrieval_scores is None
    assert reject({**VALID, "retrieval_scores": [1, 2]}).field == "retrieval_scores"
    assert reject({**VALID, "retrieval_scores": [1, "2", 3]}).field == "retrieval_scores[1]"
    assert reject({**VALID, "retrieval_scores": [1, True, 3]}).field == "retrieval_scores[1]"
    assert reject({**VALID, "retrieval_scores": [1, 2, 3], "retrieval_weight": -1}).field == "retrieval_weight"
    assert reject({**VALID, "retrieval_weight": 2}).field == "retrieval_weight"
    generate = {**VALID, "mode": "generate", "retrieval_scores": [1, 2, 3]}
    assert reject(generate).field == "retrieval_scores"
