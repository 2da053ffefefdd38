"""Segments, prompts and block keys: the vocabulary every component shares.

A *segment* is a run of token ids with a kind (system, history, item, instruction, free). A prompt
is *defined* as the concatenation of its segments' token ids: segments are tokenized separately
and never re-tokenized as a joined string, so a cached segment and the full prompt agree token for
token by construction.

A segment's *block key* names its KV block in every tier and on every pod. It is a cryptographic
hash of what determines the KV: the model identity (name, weights revision, tokenizer, dtype), the
segment kind and its token ids, plus the prefill context (how the block was computed, e.g.
standalone or behind the system prefix). Never its position: the same item at offset 40 or 900 has
one key, and the engine re-rotates keys to where they land. Python's ``hash()`` is never used, as it
differs per process (PYTHONHASHSEED).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

KEY_SCHEME = b"kvshard-block-v1"
KEY_HEX_LENGTH = 64  # blake2b with a 32-byte digest


class SegmentKind(enum.StrEnum):
    """What a segment holds; decides its caching policy (history is replicated, items sharded)."""

    SYSTEM = "system"
    HISTORY = "history"
    ITEM = "item"
    INSTRUCTION = "instruction"
    FREE = "free"


@dataclass(frozen=True)
class ModelIdentity:
    """Everything about the model that changes a block's KV bytes.

    ``revision`` is a hash of the weights (or a hub revision), ``tokenizer`` a hash of the
    tokenizer files, ``dtype`` the dtype the KV was computed in. ``template`` is the prompt
    template's fingerprint (:mod:`kvshard.prompt_template`): a block computed under one system text
    is never served under another. It is empty for the default template, so the keys of blocks
    stored before templates existed (computed under exactly that text) do not change.
    """

    name: str
    revision: str
    tokenizer: str
    dtype: str = "float32"
    template: str = ""

    def fingerprint(self) -> bytes:
        fields = (self.name, self.revision, self.tokenizer, self.dtype)
        return _join_fields(*fields, self.template) if self.template else _join_fields(*fields)


@dataclass(frozen=True)
class Segment:
    """A run of token ids with a kind; ``text`` is kept for display and debugging only."""

    kind: SegmentKind
    token_ids: tuple[int, ...]
    text: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, SegmentKind):
            object.__setattr__(self, "kind", SegmentKind(self.kind))
        if not self.token_ids:
            raise ValueError(f"a {self.kind.value} segment needs at least one token")
        if any((not isinstance(t, int)) or t < 0 or t >= 2**32 for t in self.token_ids):
            raise ValueError("token ids must be integers in [0, 2**32)")

    def __len__(self) -> int:
        return len(self.token_ids)


def block_key(identity: ModelIdentity, segment: Segment, context: str = "") -> str:
    """The stable block key of ``segment`` for ``identity`` (64 hex characters).

    ``context`` names how the block's KV was computed (``""`` = standalone at position 0); blocks
    prefilled behind a prefix must pass that prefix's key so the two never collide.
    """
    digest = hashlib.blake2b(digest_size=32)
    digest.update(KEY_SCHEME)
    digest.update(identity.fingerprint())
    digest.update(_join_fields(segment.kind.value, context))
    digest.update(struct.pack(f"<I{len(segment.token_ids)}I", len(segment.token_ids), *segment.token_ids))
    return digest.hexdigest()


def is_block_key(text: str) -> bool:
    """True if ``text`` looks like a block key (safe to use as a file or URL name)."""
    return len(text) == KEY_HEX_LENGTH and all(c in "0123456789abcdef" for c in text)


def _join_fields(*fields: str) -> bytes:
    # Length-prefixed so ("ab", "c") and ("a", "bc") can never hash alike.
    out = bytearray()
    for value in fields:
        encoded = value.encode("utf-8")
        out += struct.pack("<I", len(encoded)) + encoded
    return bytes(out)


@dataclass(frozen=True)
class Span:
    """Where one segment lands in a prompt: token positions ``[start, end)``."""

    segment: Segment
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.segment)


@dataclass(frozen=True)
class Prompt:
    """An ordered list of segments; its token ids are their concatenation, by definition."""

    segments: tuple[Segment, ...]

    @classmethod
    def of(cls, segments: Iterable[Segment]) -> Prompt:
        return cls(tuple(segments))

    @property
    def token_ids(self) -> list[int]:
        return [t for segment in self.segments for t in segment.token_ids]

    def __len__(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def spans(self) -> list[Span]:
        spans, offset = [], 0
        for segment in self.segments:
            spans.append(Span(segment, offset))
            offset += len(segment)
        return spans

    def tokens_by_kind(self) -> dict[SegmentKind, int]:
        counts: dict[SegmentKind, int] = {}
        for segment in self.segments:
            counts[segment.kind] = counts.get(segment.kind, 0) + len(segment)
        return counts
