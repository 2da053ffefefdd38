"""The prompt template: defaults are today's MovieLens prompt, placeholders are plain names, and the
template decides block keys."""

from __future__ import annotations

import pytest

from kvshard import prompts
from kvshard.prompt_template import DEFAULT_TEMPLATE, PromptTemplate, TemplateError, missing_fields
from kvshard.segments import ModelIdentity, Segment, SegmentKind, block_key


def test_defaults_are_the_movielens_prompt_and_have_no_fingerprint() -> None:
    assert PromptTemplate.from_spec(None) == PromptTemplate.from_spec({}) == DEFAULT_TEMPLATE
    assert DEFAULT_TEMPLATE.system == prompts.DEFAULT_SYSTEM_TEXT
    assert DEFAULT_TEMPLATE.question == prompts.DEFAULT_QUESTION
    assert DEFAULT_TEMPLATE.fingerprint == ""
    assert PromptTemplate.from_spec(DEFAULT_TEMPLATE.as_spec()).fingerprint == ""


def test_item_lines_render_text_and_other_fields_with_literal_braces() -> None:
    template = PromptTemplate.from_spec({"itemFormat": "{text} by {author} {{hardcover}}"})
    assert template.item_fields == ["author"]
    assert template.item_line("Dune", {"author": "Herbert"}) == "Dune by Herbert {hardcover}"
    problems = missing_fields(template, [("1", {"author": "a"}), ("2", {}), ("3", {"x": "y"})])
    assert problems == ["item '2' has no field 'author' (spec.prompt.itemFormat uses it)",
                        "item '3' has no field 'author' (spec.prompt.itemFormat uses it)"]


@pytest.mark.parametrize(("spec", "message"), [
    ({"itemFormat": "{title}"}, "must contain {text}"),
    ({"itemFormat": "{text.upper}"}, "plain field name"),
    ({"itemFormat": "{text!r}"}, "plain field name"),
    ({"itemFormat": "{text:>10}"}, "plain field name"),
    ({"itemFormat": "{text"}, "literal braces"),
    ({"itemFormat": "{text}\n{x}"}, "one line"),
    ({"systemText": "   "}, "systemText: must not be empty"),
    ({"question": "x" * 4001}, "question: 4001 characters"),
    ({"system": "x"}, "unknown field"),
])
def test_a_template_that_cannot_render_names_its_field(spec: dict[str, str], message: str) -> None:
    with pytest.raises(TemplateError, match=message.replace("{", r"\{").replace("}", r"\}").replace(".", r"\.")):
        PromptTemplate.from_spec(spec)


def test_a_changed_system_text_changes_every_block_key_even_a_standalone_items() -> None:
    base = ModelIdentity("m", "r", "t")
    shop = PromptTemplate.from_spec({"systemText": "You recommend books."})
    shop2 = PromptTemplate.from_spec({"systemText": "You recommend books!"})
    item = Segment(SegmentKind.ITEM, (5, 6, 7))
    keys = {block_key(ModelIdentity("m", "r", "t", template=t.fingerprint), item)
            for t in (DEFAULT_TEMPLATE, shop, shop2)}
    assert len(keys) == 3
    assert block_key(base, item) == block_key(ModelIdentity("m", "r", "t", template=""), item)


def test_the_label_position_is_before_by_default_and_after_changes_the_fingerprint() -> None:
    after = PromptTemplate.from_spec({"labelPosition": "after"})
    assert DEFAULT_TEMPLATE.label_position == "before" and "labelPosition" not in DEFAULT_TEMPLATE.as_spec()
    assert PromptTemplate.from_spec({"labelPosition": "before"}).fingerprint == ""
    assert after.as_spec()["labelPosition"] == "after" and after.fingerprint not in ("", DEFAULT_TEMPLATE.fingerprint)
    assert (DEFAULT_TEMPLATE.label_text("C"), after.label_text("C")) == ("C. ", " [C]\n")
    with pytest.raises(TemplateError, match="spec.prompt.labelPosition: 'middle'"):
        PromptTemplate.from_spec({"labelPosition": "middle"})
