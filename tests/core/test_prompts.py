"""The prompt builder: segments that concatenate to exactly the prompt, reproducible candidates."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvshard.prompts import PromptBuilder, PromptTemplate, RecommendationRequest, candidate_orders, sample_requests
from kvshard.segments import SegmentKind

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def builder(smollm2: Any, movielens: Any) -> PromptBuilder:
    return PromptBuilder(smollm2.tokenizer, movielens)


def test_segment_concatenation_is_exactly_the_prompt_tokens(builder: PromptBuilder, movielens: Any) -> None:
    request = sample_requests(movielens, users=1, history=30, candidates=20, seed=3)[0]
    built = builder.build(request)
    spans = built.prompt.spans
    tokens = built.prompt.token_ids
    assert len(tokens) == len(built.prompt) == spans[-1].end
    for span in spans:
        assert tuple(tokens[span.start : span.end]) == span.segment.token_ids
    # Each segment is its text tokenized alone: what is cached is what is served.
    for segment in built.prompt.segments:
        assert list(segment.token_ids) == builder.tokenizer.encode(segment.text, add_special_tokens=False)


def test_prompt_layout_is_system_history_candidates_instruction(builder: PromptBuilder, movielens: Any) -> None:
    request = sample_requests(movielens, users=1, history=5, candidates=4, seed=0)[0]
    kinds = [s.kind for s in builder.build(request).prompt.segments]
    assert kinds[:3] == [SegmentKind.SYSTEM, SegmentKind.HISTORY, SegmentKind.FREE]
    assert kinds[3:-1] == [SegmentKind.FREE, SegmentKind.ITEM] * 4
    assert kinds[-1] == SegmentKind.INSTRUCTION


def test_an_item_has_one_segment_whatever_its_label(builder: PromptBuilder, movielens: Any) -> None:
    first, second = sample_requests(movielens, users=2, history=5, candidates=10, seed=1)
    item = first.candidates[0]
    other = (item, *[c for c in second.candidates if c != item][:3])
    a = builder.build(first).prompt.segments
    b = builder.build(second.__class__(second.user_id, second.history, tuple(reversed(other)))).prompt.segments
    segment = builder.item_segment(item)
    assert segment in a and segment in b


def test_labels_are_single_tokens_and_name_candidates(builder: PromptBuilder, movielens: Any) -> None:
    request = sample_requests(movielens, users=1, history=30, candidates=80, seed=2)[0]
    built = builder.build(request)
    assert len(built.labels) == 80 and len(set(built.labels)) == 80
    for label, token in zip(built.labels, built.label_token_ids, strict=True):
        assert builder.tokenizer.encode(label, add_special_tokens=False) == [token]
    assert built.candidate_for_label(built.labels[5]) == request.candidates[5]


def test_chat_template_wraps_the_prompt(builder: PromptBuilder, movielens: Any) -> None:
    request = sample_requests(movielens, users=1, history=3, candidates=3, seed=0)[0]
    text = builder.tokenizer.decode(builder.build(request).prompt.token_ids)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n")


def test_sampled_requests_are_seeded_and_hold_out_the_next_item(movielens: Any) -> None:
    once = sample_requests(movielens, users=5, history=30, candidates=20, seed=7)
    again = sample_requests(movielens, users=5, history=30, candidates=20, seed=7)
    assert once == again
    assert once != sample_requests(movielens, users=5, history=30, candidates=20, seed=8)
    for request in once:
        full = movielens.histories[request.user_id]
        assert request.target == full[-1] and list(request.history) == full[-31:-1]
        assert request.target in request.candidates and len(set(request.candidates)) == 20
        assert not (set(request.candidates) - {request.target}) & set(full)


def test_unknown_items_and_too_many_candidates_are_refused(builder: PromptBuilder, movielens: Any) -> None:
    request = sample_requests(movielens, users=1, history=3, candidates=3, seed=0)[0]
    with pytest.raises(KeyError, match="unknown item"):
        builder.build(request.__class__(request.user_id, request.history, ("no-such-item",)))
    too_many = tuple(sorted(movielens.items))[: builder.max_candidates + 1]
    with pytest.raises(ValueError, match="at most"):
        builder.build(request.__class__(request.user_id, request.history, too_many))


def test_with_the_label_after_its_item_each_candidate_line_ends_with_its_label(
        smollm2: Any, movielens: Any, builder: PromptBuilder) -> None:
    after = PromptBuilder(smollm2.tokenizer, movielens, template=PromptTemplate(label_position="after"))
    request = sample_requests(movielens, users=1, history=5, candidates=20, seed=4)[0]
    built = after.build(request)
    segments = built.prompt.segments
    assert [s.kind for s in segments[3:-1]] == [SegmentKind.ITEM, SegmentKind.FREE] * 20
    for index, (label, token) in enumerate(zip(built.labels, built.label_token_ids, strict=True)):
        item, label_segment = segments[3 + 2 * index], segments[4 + 2 * index]
        assert item.text == after.item_line(movielens.items[request.candidates[index]])
        assert label_segment.text == f" [{label}]\n" and token in label_segment.token_ids
    assert built.labels == builder.build(request).labels  # the same letters answer in both positions
    for segment in segments:
        assert list(segment.token_ids) == after.tokenizer.encode(segment.text, add_special_tokens=False)


def test_candidate_orders_reshuffle_the_same_candidates_reproducibly() -> None:
    request = RecommendationRequest("u", ("h",), tuple(f"c{i}" for i in range(8)), target="c3")
    orders = candidate_orders(request, 3, random.Random(7))
    assert orders[0] == request and len(orders) == 3
    assert all(sorted(o.candidates) == sorted(request.candidates) and o.target == "c3" for o in orders)
    assert len({o.candidates for o in orders}) == 3  # 8! orders: three draws differ
    assert candidate_orders(request, 3, random.Random(7)) == orders
