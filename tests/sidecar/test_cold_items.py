"""Cold items: a request may bring items the catalog lacks, with their text inline; unknown ids
without text stay a 422 naming them. The router routes inline items by their id."""

from __future__ import annotations

import json

import pytest

from kvshard.datasets import Item
from kvshard.request_errors import RequestError
from kvshard_router.validation import parse_recommend as route
from kvshard_sidecar.api.validation import Limits, parse_recommend

CATALOG = {"1": Item("1", "Dune"), "2": Item("2", "Emma")}


def test_inline_items_the_catalog_lacks_are_collected_and_known_ones_use_the_catalog() -> None:
    body = {"user_id": "u", "history": ["1", {"id": "h9", "text": "Ulysses", "author": "Joyce"}],
            "candidates": ["2", {"id": "n1", "text": "  New\\nbook  "}, {"id": 1, "text": "ignored: in catalog"}]}
    call = parse_recommend(body, CATALOG, Limits())
    assert call.candidates == ("2", "n1", "1") and call.history == ("1", "h9")
    assert call.inline == {"n1": Item("n1", "New\\nbook"), "h9": Item("h9", "Ulysses", {"author": "Joyce"})}


def test_unknown_ids_without_text_are_a_422_naming_all_of_them() -> None:
    body = {"user_id": "u", "candidates": ["1", "x7", {"id": "n", "text": "ok"}, "x8"]}
    with pytest.raises(RequestError) as info:
        parse_recommend(body, CATALOG, Limits())
    assert info.value.status == 422 and info.value.field == "candidates[1]"
    assert "'x7', 'x8'" in str(info.value) and '"text"' in str(info.value)


@pytest.mark.parametrize(("entry", "message"), [
    ({"id": "n"}, "field 'text' must be a non-empty string"),
    ({"id": "n", "text": ""}, "field 'text' must be a non-empty string"),
    ({"text": "no id"}, "field 'id' must be"),
    ({"id": "n", "text": "x" * 5000}, "longer than 4096"),
])
def test_a_malformed_inline_item_is_a_400_naming_its_position(entry: dict[str, object], message: str) -> None:
    with pytest.raises(RequestError, match=message) as info:
        parse_recommend({"user_id": "u", "candidates": ["1", entry]}, CATALOG, Limits())
    assert info.value.status == 400 and info.value.field == "candidates[1]"


def test_the_router_routes_inline_items_by_their_id() -> None:
    raw = json.dumps({"user_id": "u", "candidates": ["1", {"id": "n1", "text": "New"}],
                      "history": [{"id": 5, "text": "x"}]}).encode()
    request = route(raw)
    assert request.items == ("1", "n1") and request.history == ("5",)
