"""Recommendation prompts built from cacheable segments.

The prompt reads, in order::

    [system]       chat-template prefix, system text, user header          (same for everyone)
    [history]      the user's watched items, one line each                 (one block per user)
    [free]         "Candidates:" header
    [free][item]   "A. " label, then the item's text — repeated per candidate (one block per item)
    [instruction]  the question and the chat template's generation prompt (the uncached suffix)

Labels sit in their own tiny segments so an item's block is the same whichever letter it gets.
Each segment is tokenized on its own and the prompt's tokens are their concatenation: what is
cached is exactly what is served. Candidate sets are the user's held-out next item plus sampled
negatives the user never saw, shuffled; everything is seeded, so a run is reproducible.
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvshard.datasets import Dataset
from kvshard.segments import Prompt, Segment, SegmentKind

DEFAULT_SYSTEM_TEXT = (
    "You are a movie recommender. Given the movies a user watched, pick the one candidate "
    "they are most likely to watch next."
)
DEFAULT_HISTORY_HEADER = "Movies this user watched, oldest first:\n"
DEFAULT_CANDIDATES_HEADER = "\nCandidates:\n"
DEFAULT_QUESTION = "\nWhich candidate will the user watch next? Answer with its letter only."
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


def sample_requests(
    dataset: Dataset, users: int, history: int, candidates: int, seed: int = 0
) -> list[RecommendationRequest]:
    """Leave-last-out requests: the last ``history`` items before each user's final item.

    Users with fewer than ``history + 1`` interactions are skipped; negatives are drawn from the
    items the user never interacted with.
    """
    if candidates < 2:
        raise ValueError("candidates must be at least 2 (the held-out item and one negative)")
    if history < 1:
        raise ValueError("history must be at least 1")
    rng = random.Random(seed)
    eligible = [u for u, h in dataset.histories.items() if len(h) > history]
    rng.shuffle(eligible)
    all_items = sorted(dataset.items)
    requests = []
    for user in eligible[:users]:
        items = dataset.histories[user]
        target, past = items[-1], items[-1 - history : -1]
        seen = set(items)
        negatives: list[str] = []
        while len(negatives) < candidates - 1:
            choice = rng.choice(all_items)
            if choice not in seen and choice not in negatives:
                negatives.append(choice)
        pool = [target, *negatives]
        rng.shuffle(pool)
        requests.append(RecommendationRequest(user, tuple(past), tuple(pool), target))
    return requests


class PromptBuilder:
    """Turns requests into segment lists for one tokenizer and catalog.

    The system and instruction segments are rendered through the tokenizer's own chat template
    (split around a marker), so the prompt is what the model was trained to see.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        dataset: Dataset,
        system_text: str = DEFAULT_SYSTEM_TEXT,
        question: str = DEFAULT_QUESTION,
    ) -> None:
        self.tokenizer = tokenizer
        self.dataset = dataset
        rendered = tokenizer.apply_chat_template(
            [{"role": "system", "content": system_text}, {"role": "user", "content": _BODY_MARKER}],
            add_generation_prompt=True,
            tokenize=False,
        )
        if not isinstance(rendered, str) or rendered.count(_BODY_MARKER) != 1:
            raise ValueError("the tokenizer's chat template must render the user message exactly once")
        chat_prefix, chat_suffix = rendered.split(_BODY_MARKER)
        self.system_segment = self._segment(SegmentKind.SYSTEM, chat_prefix + DEFAULT_HISTORY_HEADER)
        self.candidates_segment = self._segment(SegmentKind.FREE, DEFAULT_CANDIDATES_HEADER)
        self.instruction_segment = self._segment(SegmentKind.INSTRUCTION, question + chat_suffix)
        self.labels, self.label_token_ids = self._single_token_labels()
        self._label_segments = [self._segment(SegmentKind.FREE, f"{label}. ") for label in self.labels]
        self._item_segments: dict[str, Segment] = {}

    @property
    def max_candidates(self) -> int:
        return len(self.labels)

    def _segment(self, kind: SegmentKind, text: str) -> Segment:
        return Segment(kind, tuple(self.tokenizer.encode(text, add_special_tokens=False)), text)

    def _single_token_labels(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        labels, ids = [], []
        for label in LABEL_ALPHABET:
            encoded = self.tokenizer.encode(label, add_special_tokens=False)
            if len(encoded) == 1:
                labels.append(label)
                ids.append(encoded[0])
        return tuple(labels), tuple(ids)

    def item_segment(self, item_id: str) -> Segment:
        """The item's segment (memoised: the catalog is fixed for a builder)."""
        segment = self._item_segments.get(item_id)
        if segment is None:
            item = self.dataset.items.get(item_id)
            if item is None:
                raise KeyError(f"unknown item id {item_id!r}")
            segment = self._segment(SegmentKind.ITEM, item.text + "\n")
            self._item_segments[item_id] = segment
        return segment

    def history_segment(self, history: Sequence[str]) -> Segment:
        lines = []
        for item_id in history:
            item = self.dataset.items.get(item_id)
            if item is None:
                raise KeyError(f"unknown item id {item_id!r}")
            lines.append(f"- {item.text}\n")
        return self._segment(SegmentKind.HISTORY, "".join(lines))

    def build(self, request: RecommendationRequest) -> RecommendationPrompt:
        if not request.candidates:
            raise ValueError("a request needs at least one candidate")
        if len(request.candidates) > self.max_candidates:
            raise ValueError(f"at most {self.max_candidates} candidates fit the single-token labels")
        segments = [self.system_segment]
        if request.history:
            segments.append(self.history_segment(request.history))
        segments.append(self.candidates_segment)
        for label_segment, item_id in zip(self._label_segments, request.candidates, strict=False):
            segments += [label_segment, self.item_segment(item_id)]
        segments.append(self.instruction_segment)
        count = len(request.candidates)
        return RecommendationPrompt(
            request=request,
            prompt=Prompt.of(segments),
            labels=self.labels[:count],
            label_token_ids=self.label_token_ids[:count],
        )
