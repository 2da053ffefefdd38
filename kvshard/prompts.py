"""Recommendation prompts built from cacheable segments.

The prompt reads, in order::

    [system]       chat-template prefix, system text, user header          (same for everyone)
    [history]      the user's watched items, one line each                 (one block per user)
    [free]         "Candidates:" header
    [free][item]   "A. " label, then the item's text — repeated per candidate (one block per item);
                   or [item][free], the item's text then " [A]" (``labelPosition: after``)
    [instruction]  the question and the chat template's generation prompt (the uncached suffix)

Labels sit in their own tiny segments so an item's block is the same whichever letter it gets.
Each segment is tokenized on its own and the prompt's tokens are their concatenation: what is
cached is exactly what is served. Candidate sets are the user's held-out next item plus sampled
negatives the user never saw, shuffled; everything is seeded, so a run is reproducible.
"""

from __future__ import annotations

import random
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvshard.datasets import Dataset, Item
from kvshard.prompt_template import (
    DEFAULT_CANDIDATES_HEADER,
    DEFAULT_HISTORY_HEADER,
    DEFAULT_QUESTION,
    DEFAULT_SYSTEM_TEXT,
    DEFAULT_TEMPLATE,
    PromptTemplate,
)
from kvshard.segments import Prompt, Segment, SegmentKind

__all__ = ["DEFAULT_CANDIDATES_HEADER", "DEFAULT_HISTORY_HEADER", "DEFAULT_QUESTION", "DEFAULT_SYSTEM_TEXT",
           "LABEL_ALPHABET", "PromptBuilder", "PromptTemplate", "RecommendationPrompt", "RecommendationRequest",
           "sample_requests"]

_BODY_MARKER = "\u2063KVSHARD-BODY\u2063"
# Single letters first, then digits and letter pairs; only those that are one token are used, so the
# answer is always the first generated token.
LABEL_ALPHABET = tuple(
    list(string.ascii_uppercase + string.ascii_lowercase + string.digits)
    + [a + b for a in string.ascii_uppercase for b in string.ascii_uppercase]
)


class TextTokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the builder needs."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class RecommendationRequest:
    """One recommendation: a user's history and the candidates to choose among."""

    user_id: str
    history: tuple[str, ...]
    candidates: tuple[str, ...]
    target: str | None = None  # the held-out item when sampled from a dataset
    later_targets: tuple[str, ...] = ()
    """Training only (``kvshard model finetune --positives``): the items the user watched right after
    ``target``, also among the candidates and also counted as positives."""

    @property
    def target_index(self) -> int | None:
        return self.candidates.index(self.target) if self.target in self.candidates else None


@dataclass(frozen=True)
class RecommendationPrompt:
    """A built prompt plus what is needed to read the answer back."""

    request: RecommendationRequest
    prompt: Prompt
    labels: tuple[str, ...]
    label_token_ids: tuple[int, ...]

    @property
    def target_index(self) -> int | None:
        return self.request.target_index

    def candidate_for_label(self, label: str) -> str | None:
        return self.request.candidates[self.labels.index(label)] if label in self.labels else None


def candidate_orders(request: RecommendationRequest, count: int, rng: random.Random) -> list[RecommendationRequest]:
    """``request`` and ``count - 1`` reshuffles of its candidates drawn from ``rng`` (the same request
    under other candidate orders: position consistency is measured, and trained, on them)."""
    orders = [request]
    for _ in range(count - 1):
        shuffled = list(request.candidates)
        rng.shuffle(shuffled)
        orders.append(replace(request, candidates=tuple(shuffled)))
    return orders


def sample_requests(
    dataset: Dataset, users: int, history: int, candidates: int, seed: int = 0, positions: int = 1
) -> list[RecommendationRequest]:
    """Leave-last-out requests: the last ``history`` items before each user's final item.

    Users with fewer than ``history + 1`` interactions are skipped; negatives are drawn from the
    items the user never interacted with. ``positions`` > 1 also takes each user's earlier items as
    targets — the last ``positions`` interactions, latest first, each with the ``history`` items before
    it (a position without that much history is skipped) — so a sample of held-out users yields more
    requests than users (the user's requests are correlated: intervals resample users, see
    :func:`request_users`). The last items' requests are the same whatever ``positions`` is (an earlier
    position draws from its own generator, :func:`position_rng`), so ``positions`` 1 is a subset of 5.
    """
    if candidates < 2:
        raise ValueError("candidates must be at least 2 (the held-out item and one negative)")
    if history < 1:
        raise ValueError("history must be at least 1")
    if positions < 1:
        raise ValueError("positions must be at least 1")
    rng = random.Random(seed)
    eligible = [u for u, h in dataset.histories.items() if len(h) > history]
    rng.shuffle(eligible)
    all_items = sorted(dataset.items)
    requests = []
    for user in eligible[:users]:
        items = dataset.histories[user]
        seen = set(items)
        for end in target_positions(len(items), history, positions):
            target, past = items[end], items[end - history : end]
            draw = rng if end == len(items) - 1 else position_rng(seed, user, end)
            negatives: list[str] = []
            while len(negatives) < candidates - 1:
                choice = draw.choice(all_items)
                if choice not in seen and choice not in negatives:
                    negatives.append(choice)
            pool = [target, *negatives]
            draw.shuffle(pool)
            requests.append(RecommendationRequest(user, tuple(past), tuple(pool), target))
    return requests


def position_rng(seed: int, user: str, position: int) -> random.Random:
    """The generator of a user's request at an earlier ``position`` (not the last item): its own, so adding
    positions never changes the last items' requests."""
    return random.Random(f"{seed}-{user}-{position}")


def target_positions(interactions: int, history: int, positions: int) -> list[int]:
    """Indices of a user's targets: the last ``positions`` interactions, latest first, each with at least
    ``history`` interactions before it."""
    return [end for end in range(interactions - 1, interactions - 1 - positions, -1) if end >= history]


def request_users(requests: Sequence[RecommendationRequest]) -> list[str]:
    """Each request's user: the clusters a bootstrap over users resamples (several requests of one user,
    ``positions`` > 1, move together)."""
    return [request.user_id for request in requests]


class PromptBuilder:
    """Turns requests into segment lists for one tokenizer, catalog and prompt template.

    The system and instruction segments are rendered through the tokenizer's own chat template
    (split around a marker), so the prompt is what the model was trained to see. ``system_text``
    and ``question`` override the template's (a request's own instruction uses ``question``).
    Items not in the catalog can be given to :meth:`build` inline (cold items): their segments
    are built the same way, but not memoised, so a stream of one-off items cannot grow memory.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        dataset: Dataset,
        system_text: str | None = None,
        question: str | None = None,
        template: PromptTemplate = DEFAULT_TEMPLATE,
    ) -> None:
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.template = template
        system_text = template.system if system_text is None else system_text
        question = template.question if question is None else question
        rendered = tokenizer.apply_chat_template(
            [{"role": "system", "content": system_text}, {"role": "user", "content": _BODY_MARKER}],
            add_generation_prompt=True,
            tokenize=False,
        )
        if not isinstance(rendered, str) or rendered.count(_BODY_MARKER) != 1:
            raise ValueError("the tokenizer's chat template must render the user message exactly once")
        chat_prefix, chat_suffix = rendered.split(_BODY_MARKER)
        self.system_segment = self._segment(SegmentKind.SYSTEM, chat_prefix + template.history_header)
        self.candidates_segment = self._segment(SegmentKind.FREE, template.candidates_header)
        self.instruction_segment = self._segment(SegmentKind.INSTRUCTION, question + chat_suffix)
        self.labels, self.label_token_ids = self._single_token_labels()
        self.label_segments = tuple(self._segment(SegmentKind.FREE, template.label_text(label))
                                    for label in self.labels)
        """Each label's own segment (``"A. "`` or ``" [A]\n"``), tokenized once."""
        self._item_segments: dict[str, Segment] = {}

    @property
    def max_candidates(self) -> int:
        return len(self.labels)

    def _segment(self, kind: SegmentKind, text: str) -> Segment:
        return Segment(kind, tuple(self.tokenizer.encode(text, add_special_tokens=False)), text)

    def _single_token_labels(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Labels that are one token, and that same token inside their label segment (the answer
        copies it from there)."""
        labels, ids = [], []
        for label in LABEL_ALPHABET:
            encoded = self.tokenizer.encode(label, add_special_tokens=False)
            in_segment = self.tokenizer.encode(self.template.label_text(label), add_special_tokens=False)
            if len(encoded) == 1 and encoded[0] in in_segment:
                labels.append(label)
                ids.append(encoded[0])
        return tuple(labels), tuple(ids)

    def _item(self, item_id: str, inline: Mapping[str, Item]) -> Item:
        item = self.dataset.items.get(item_id) or inline.get(item_id)
        if item is None:
            raise KeyError(f"unknown item id {item_id!r}")
        return item

    def item_line(self, item: Item) -> str:
        """The item as the template shows it (KeyError when it lacks a field the format uses)."""
        return self.template.item_line(item.text, item.fields)

    def item_segment(self, item_id: str, inline: Mapping[str, Item] | None = None) -> Segment:
        """The item's segment (memoised for catalog items: the catalog is fixed for a builder)."""
        segment = self._item_segments.get(item_id)
        if segment is None:
            item = self._item(item_id, inline or {})
            end = "" if self.template.label_after else "\n"  # after: the label segment ends the line
            segment = self._segment(SegmentKind.ITEM, self.item_line(item) + end)
            if item_id in self.dataset.items:
                self._item_segments[item_id] = segment
        return segment

    def history_segment(self, history: Sequence[str], inline: Mapping[str, Item] | None = None) -> Segment:
        lines = [f"- {self.item_line(self._item(item_id, inline or {}))}\n" for item_id in history]
        return self._segment(SegmentKind.HISTORY, "".join(lines))

    def build(self, request: RecommendationRequest, inline: Mapping[str, Item] | None = None) -> RecommendationPrompt:
        """The prompt of ``request``; ``inline`` holds items the catalog does not have (cold items)."""
        if not request.candidates:
            raise ValueError("a request needs at least one candidate")
        if len(request.candidates) > self.max_candidates:
            raise ValueError(f"at most {self.max_candidates} candidates fit the single-token labels")
        segments = [self.system_segment]
        if request.history:
            segments.append(self.history_segment(request.history, inline))
        segments.append(self.candidates_segment)
        for label_segment, item_id in zip(self.label_segments, request.candidates, strict=False):
            item_segment = self.item_segment(item_id, inline)
            segments += [item_segment, label_segment] if self.template.label_after else [label_segment, item_segment]
        segments.append(self.instruction_segment)
        count = len(request.candidates)
        return RecommendationPrompt(
            request=request,
            prompt=Prompt.of(segments),
            labels=self.labels[:count],
            label_token_ids=self.label_token_ids[:count],
        )
