"""The prompt template a CacheShard carries (``spec.prompt``): what the recommender is told.

A shop, a news site and a music service each say what they are, so the texts around the segments
are the user's: the system text, the history header, the candidates header, the question, and the
format of one item line (``{text}`` plus, optionally, other fields of the catalog's items, e.g.
``{text} ({brand})``). The *structure* is fixed — system, history, a free ``Candidates:`` header, a
free label plus one item per candidate, the question — because blending, fine-tuning and the
block layout rely on it. Only where the label stands is a choice (``labelPosition``): ``before``
(``A. <item>``, the default) or ``after`` (``<item> [A]``). A model fine-tuned on one must be served
with it: with the label first, the label token cannot see its item under the causal mask, and a
short fine-tune does not learn to point at a candidate (bench/experiments/finetune_label_position_probe.py);
with the label after its item, the label token has read the item and the answer copies it.

A template decides every block's tokens, so it is part of every block key
(:attr:`PromptTemplate.fingerprint` goes into the model identity): a changed system text never
serves blocks computed under the old one, even where the block's own tokens did not change
(standalone prefill). The default template's fingerprint is empty, so the blocks stored before
templates existed — computed under exactly this text — stay valid.

Placeholders are plain names (``{brand}``); attribute access, indexing, conversions and format
specs are refused, so a template can never reach into Python objects. ``{{`` and ``}}`` are literal
braces.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import string
from collections.abc import Iterable, Mapping
from typing import Any

DEFAULT_SYSTEM_TEXT = (
    "You are a movie recommender. Given the movies a user watched, pick the one candidate "
    "they are most likely to watch next."
)
DEFAULT_HISTORY_HEADER = "Movies this user watched, oldest first:\n"
DEFAULT_CANDIDATES_HEADER = "\nCandidates:\n"
DEFAULT_QUESTION = "\nWhich candidate will the user watch next? Answer with its letter only."
DEFAULT_ITEM_FORMAT = "{text}"
LABEL_POSITIONS = ("before", "after")

MAX_TEXT_CHARS = 4000
"""Longest system text or question (the CRD says the same): every prompt pays for them."""
MAX_HEADER_CHARS = 500
MAX_ITEM_FORMAT_CHARS = 500
FIELD_NAME = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"
SPEC_FIELDS = {"systemText": "system", "historyHeader": "history_header", "candidatesHeader": "candidates_header",
               "question": "question", "itemFormat": "item_format", "labelPosition": "label_position"}


class TemplateError(ValueError):
    """A template that cannot render; the message names the ``spec.prompt`` field."""


def placeholders(fmt: str, where: str = "spec.prompt.itemFormat") -> list[str]:
    """The field names ``fmt`` uses, in order; :class:`TemplateError` for anything but plain names."""
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(fmt))
    except ValueError as exc:
        raise TemplateError(f"{where}: {exc} (write {{{{ and }}}} for literal braces)") from None
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name or any(c not in FIELD_NAME for c in name) or spec or conversion:
            raise TemplateError(f"{where}: placeholder {{{name}{'!' + conversion if conversion else ''}"
                                f"{':' + spec if spec else ''}}} must be a plain field name such as {{text}}")
        names.append(name)
    return names


def render(fmt: str, values: Mapping[str, str]) -> str:
    """``fmt`` with every placeholder replaced by ``values[name]`` (KeyError names a missing one)."""
    out: list[str] = []
    for literal, name, _spec, _conversion in string.Formatter().parse(fmt):
        out.append(literal)
        if name is not None:
            out.append(values[name])
    return "".join(out)


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    """The texts around the segments; defaults are today's MovieLens prompt."""

    system: str = DEFAULT_SYSTEM_TEXT
    history_header: str = DEFAULT_HISTORY_HEADER
    candidates_header: str = DEFAULT_CANDIDATES_HEADER
    question: str = DEFAULT_QUESTION
    item_format: str = DEFAULT_ITEM_FORMAT
    label_position: str = "before"
    """``before``: ``A. <item>``; ``after``: ``<item> [A]``."""

    def __post_init__(self) -> None:
        limits = {"system": MAX_TEXT_CHARS, "question": MAX_TEXT_CHARS, "history_header": MAX_HEADER_CHARS,
                  "candidates_header": MAX_HEADER_CHARS, "item_format": MAX_ITEM_FORMAT_CHARS}
        spec_name = {v: k for k, v in SPEC_FIELDS.items()}
        for name, limit in limits.items():
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TemplateError(f"spec.prompt.{spec_name[name]}: must be a string")
            if len(value) > limit:
                raise TemplateError(f"spec.prompt.{spec_name[name]}: {len(value)} characters; at most {limit}")
        for name in ("system", "question"):
            if not getattr(self, name).strip():
                raise TemplateError(f"spec.prompt.{spec_name[name]}: must not be empty")
        if "text" not in placeholders(self.item_format):
            raise TemplateError("spec.prompt.itemFormat: must contain {text} (the item's own text)")
        if "\n" in self.item_format:
            raise TemplateError("spec.prompt.itemFormat: must be one line (each item is one line of the prompt)")
        if self.label_position not in LABEL_POSITIONS:
            raise TemplateError(f"spec.prompt.labelPosition: {self.label_position!r}; must be one of "
                                f"{', '.join(LABEL_POSITIONS)}")

    @property
    def item_fields(self) -> list[str]:
        """The item fields the item line uses besides ``text``."""
        return [name for name in dict.fromkeys(placeholders(self.item_format)) if name != "text"]

    def item_line(self, text: str, fields: Mapping[str, str] | None = None) -> str:
        """One item as the prompt shows it (no newline)."""
        return render(self.item_format, {**(fields or {}), "text": text})

    @property
    def fingerprint(self) -> str:
        """What block keys depend on: ``""`` for the default template, else a hash of every field."""
        if self == DEFAULT_TEMPLATE:
            return ""
        return hashlib.blake2b(self.encode(), digest_size=16).hexdigest()

    @property
    def label_after(self) -> bool:
        return self.label_position == "after"

    def label_text(self, label: str) -> str:
        """A candidate's label segment: ``"A. "`` before its item line, ``" [A]\n"`` after it (the
        label segment then ends the line; before, the item's segment does)."""
        return f" [{label}]\n" if self.label_after else f"{label}. "

    def as_spec(self) -> dict[str, str]:
        """The template as ``spec.prompt`` spells it (``labelPosition`` only when not the default, so
        the fingerprints of templates made before it existed stay as they were)."""
        spec = {name: getattr(self, attr) for name, attr in SPEC_FIELDS.items()}
        if self.label_position == "before":
            del spec["labelPosition"]
        return spec

    def encode(self) -> bytes:
        return json.dumps(self.as_spec(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None) -> PromptTemplate:
        """A template from ``spec.prompt`` (missing fields take the defaults)."""
        if not spec:
            return DEFAULT_TEMPLATE
        unknown = sorted(set(spec) - set(SPEC_FIELDS))
        if unknown:
            raise TemplateError(f"spec.prompt.{unknown[0]}: unknown field (allowed: {', '.join(SPEC_FIELDS)})")
        return cls(**{SPEC_FIELDS[k]: v for k, v in spec.items()})


DEFAULT_TEMPLATE = PromptTemplate()


def missing_fields(template: PromptTemplate, items: Iterable[tuple[str, Mapping[str, str]]],
                   limit: int = 5) -> list[str]:
    """``"item <id> has no field 'brand'"`` for the first ``limit`` items the template cannot render."""
    needed = template.item_fields
    if not needed:
        return []
    problems: list[str] = []
    for item_id, fields in items:
        lacking = [name for name in needed if name not in fields]
        if lacking:
            problems.append(f"item {item_id!r} has no field {lacking[0]!r} (spec.prompt.itemFormat uses it)")
            if len(problems) >= limit:
                break
    return problems
