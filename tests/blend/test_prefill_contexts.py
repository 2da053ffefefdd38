"""Block prefill contexts: what precedes a block when it is prefilled, and its place in the block key.

Covers the two corrections of issue 12 item 3 built on ``BlendSettings.prefill_context``: the
in-list ``neutral`` context (system + list header + label before item blocks, the history behind
system + history header) and ``averaged`` item blocks (the mean of an item's position-free KV over
a few seeded in-list appearances). Tiny random models: no weights needed.
"""

from __future__ import annotations

import pytest
import torch
from blend_helpers import TINY_IDENTITY, tiny_model, tiny_prompt

from kvshard.segments import Prompt, Segment, SegmentKind
from kvshard_sidecar.engine import BlendEngine, BlendSettings, MemoryBlockSource, SettingsError
from kvshard_sidecar.engine.contexts import average_blocks, averaging_contexts
from kvshard_sidecar.engine.methods import method_settings
from kvshard_sidecar.engine.rope import rotate_keys

HEADER = (20, 21)
LABELS = ((30,), (31,), (32,), (33,))
FILLERS = tuple((40 + i, 41 + i, 42 + i) for i in range(0, 30, 3))
CONTEXTS = averaging_contexts(HEADER, LABELS, FILLERS, appearances=3, seed=0)
ITEM = 3  # tiny_prompt: system, history, free, ITEM, free, item, instruction


def averaged(contexts: tuple[tuple[int, ...], ...] = CONTEXTS, **changes: object) -> BlendSettings:
    return BlendSettings(prefill_context="averaged", averaged_contexts=contexts).with_(**changes)


def test_averaging_contexts_are_seeded_in_list_texts() -> None:
    again = averaging_contexts(HEADER, LABELS, FILLERS, appearances=3, seed=0)
    other = averaging_contexts(HEADER, LABELS, FILLERS, appearances=3, seed=1)
    assert again == CONTEXTS and other != CONTEXTS
    for a, context in enumerate(CONTEXTS):  # header, a + 1 labelled fillers, then the item's own label
        assert context[:2] == HEADER and context[-1] == LABELS[a + 1][0]
        assert len(context) == 2 + (a + 1) * 4 + 1
    drawn = [context[i + 1: i + 4] for context in CONTEXTS for i in range(2, len(context) - 1, 4)]
    assert len(set(drawn)) == 6 and set(drawn) <= set(FILLERS)  # without replacement
    with pytest.raises(ValueError, match="filler"):
        averaging_contexts(HEADER, LABELS, FILLERS[:5], appearances=3, seed=0)


def test_with_labels_after_items_each_neighbour_precedes_its_label_and_the_item_follows_the_last() -> None:
    after = averaging_contexts(HEADER, LABELS, FILLERS, appearances=3, seed=0, label_after=True)
    for a, context in enumerate(after):  # header, then a + 1 times (filler, its label); no label of the item's own
        assert context[:2] == HEADER and context[-1] == LABELS[a][0]
        assert len(context) == 2 + (a + 1) * 4
        assert [context[i + 3] for i in range(2, len(context), 4)] == [label[0] for label in LABELS[:a + 1]]
    assert {context[i:i + 3] for context in after for i in range(2, len(context), 4)} <= set(FILLERS)


def test_averaged_mode_needs_its_contexts_and_only_it_uses_them() -> None:
    with pytest.raises(SettingsError, match="averaged_contexts"):
        BlendSettings(prefill_context="averaged").validate()
    with pytest.raises(SettingsError, match="averaged_contexts"):
        BlendSettings(prefill_context="system", averaged_contexts=CONTEXTS).validate()
    assert method_settings("epic", 0.3, averaged()).averaged_contexts == ()  # baselines stay standalone
    assert method_settings("cacheblend", 0.3, averaged()).prefill_context == "standalone"


def test_average_of_one_appearance_is_that_appearance_and_of_two_their_mean() -> None:
    engine = BlendEngine(tiny_model("llama"), TINY_IDENTITY)
    segment = tiny_prompt().segments[ITEM]
    one, two = engine.prefill_segment(segment), engine.prefill_segment(segment, engine.prefill_segment(segment))
    assert average_blocks([[one]])[0] is one
    mean = average_blocks([[one], [two]])[0]
    torch.testing.assert_close(mean.values, (one.values + two.values) / 2)
    torch.testing.assert_close(mean.keys, (one.keys + two.keys) / 2)


def test_averaged_item_block_is_the_mean_of_unrotated_in_list_prefills() -> None:
    """The stored block equals the mean over appearances of a plain causal prefill of system + context +
    item, its keys rotated back by their offset: RoPE undone before averaging, not after."""
    engine = BlendEngine(tiny_model("llama"), TINY_IDENTITY)
    prompt = tiny_prompt()
    system, item = prompt.segments[0], prompt.segments[ITEM]
    settings = averaged()
    engine.ensure_blocks(Prompt.of([system, item]), settings)
    stored = engine.store.get(engine.block_keys(Prompt.of([system, item]), settings)[1])
    assert stored is not None
    keys, values = [], []
    for context in CONTEXTS:
        before = Prompt.of([system, Segment(SegmentKind.FREE, context)])
        full = engine.full(Prompt.of([*before.segments, item]))
        start = len(before)
        keys.append(torch.stack([rotate_keys(k, -start, engine.executor.inv_freq)
                                 for k in full.kv.keys[:, :, start:].unbind(0)]))
        values.append(full.kv.values[:, :, start:])
    torch.testing.assert_close(stored.block.values, torch.stack(values).mean(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stored.block.keys, torch.stack(keys).mean(0), atol=1e-5, rtol=1e-5)
    single = engine.full(Prompt.of([system, Segment(SegmentKind.FREE, CONTEXTS[0]), item]))
    assert (single.kv.values[:, :, -len(item):] - stored.block.values).abs().max() > 1e-3  # really averaged


@pytest.mark.parametrize("spec", ["none", "tail"])
def test_one_appearance_reduces_to_the_plain_neutral_context(spec: str) -> None:
    engine = BlendEngine(tiny_model("llama", seed=3), TINY_IDENTITY)
    prompt = tiny_prompt()
    one = averaged(CONTEXTS[:1])
    plain = BlendSettings(prefill_context="neutral", neutral_context=CONTEXTS[0])
    result = engine.blend(prompt, method_settings(spec, 0.3, one))
    reference = engine.blend(prompt, method_settings(spec, 0.3, plain))
    torch.testing.assert_close(result.logits, reference.logits, atol=1e-6, rtol=1e-6)
    assert result.exact_prefix_tokens == reference.exact_prefix_tokens
    assert (result.logits - engine.full(prompt).logits).abs().max() > 1e-3  # not trivially exact
    keys, plain_keys = engine.block_keys(prompt, one), engine.block_keys(prompt, plain)
    assert keys[ITEM] != plain_keys[ITEM]  # its own key even when the bytes agree
    assert [k for i, k in enumerate(keys) if i != ITEM and i != 5] == [
        k for i, k in enumerate(plain_keys) if i != ITEM and i != 5]  # non-item blocks are neutral's


@pytest.mark.parametrize("selector", ["tail", "boundary", "deviation"])
def test_full_at_ratio_one_is_unchanged_on_averaged_blocks(selector: str) -> None:
    engine = BlendEngine(tiny_model("llama", seed=3), TINY_IDENTITY)
    prompt = tiny_prompt()
    full = engine.full(prompt)
    for settings in (method_settings("full", 1.0, averaged()), averaged(selector=selector, ratio=1.0)):
        result = engine.blend(prompt, settings)
        torch.testing.assert_close(result.logits, full.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result.kv.values[:, :, : len(prompt)], full.kv.values, atol=1e-5, rtol=1e-5)
    stale = engine.blend(prompt, averaged(selector="none", ratio=0.0))
    assert (stale.logits - full.logits).abs().max() > 1e-3


def test_the_context_is_part_of_every_later_block_key() -> None:
    """Blocks computed behind different contexts never share a key, so a store holding one kind never
    serves it for another; the exact prefix (system, history) keeps one key across in-list contexts."""
    engine = BlendEngine(tiny_model("llama"), TINY_IDENTITY)
    prompt = tiny_prompt()
    modes = {
        "system": BlendSettings(prefill_context="system"),
        "neutral": BlendSettings(prefill_context="neutral", neutral_context=CONTEXTS[0]),
        "neutral-other-text": BlendSettings(prefill_context="neutral", neutral_context=CONTEXTS[1]),
        "averaged": averaged(),
        "averaged-other-seed": averaged(averaging_contexts(HEADER, LABELS, FILLERS, 3, seed=1)),
        "averaged-reordered": averaged(CONTEXTS[::-1]),
        "averaged-two": averaged(CONTEXTS[:2]),
    }
    keys = {name: engine.block_keys(prompt, settings) for name, settings in modes.items()}
    for name, found in keys.items():
        assert found[:2] == keys["system"][:2], name
    items = [found[ITEM] for found in keys.values()]
    assert len(set(items)) == len(items)
    labels = {found[4] for name, found in keys.items() if name not in ("averaged", "averaged-two")}
    assert len(labels) == 5  # a label sits behind the first context, as neutral's does with that text
    assert keys["averaged"][4] == keys["averaged-two"][4] == keys["neutral"][4]


def test_warming_an_item_stores_the_averaged_key_a_request_then_hits() -> None:
    store = MemoryBlockSource()
    engine = BlendEngine(tiny_model("llama"), TINY_IDENTITY, store)
    prompt = tiny_prompt()
    settings = averaged(selector="none", ratio=0.0)
    items = [s for s in prompt.segments if s.kind is SegmentKind.ITEM]
    for item in items:
        assert engine.ensure_blocks(Prompt.of([prompt.segments[0], item]), settings)["item"] == len(item)
    hot = engine.blend(prompt, settings)
    assert "item" not in hot.computed_tokens and hot.hit_tokens["item"]["memory"] == sum(len(s) for s in items)
    cold_system = engine.blend(prompt, BlendSettings(prefill_context="system", selector="none", ratio=0.0))
    assert cold_system.computed_tokens["item"] == sum(len(s) for s in items)  # never served across contexts


def test_benchmark_puts_averaged_contexts_under_its_methods_and_keeps_the_baselines_standalone() -> None:
    import argparse

    from kvshard_bench.fidelity import add_arguments
    from kvshard_bench.fidelity import method_settings as bench_settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--prefill-context", "averaged", "--appearances", "2", "--methods", "none", "tail",
                              "epic", "--ratios", "0.3"])
    assert args.appearances == 2
    found = {name: settings for name, _, settings in bench_settings(args, averaged=CONTEXTS[:2])}
    assert found["tail"].prefill_context == found["none"].prefill_context == "averaged"
    assert found["tail"].averaged_contexts == CONTEXTS[:2]
    assert (found["epic"].prefill_context, found["epic"].averaged_contexts) == ("standalone", ())


def test_benchmark_contexts_are_the_prompts_own_header_labels_and_catalog_items(smollm2: object,
                                                                                  movielens: object) -> None:
    from kvshard.prompts import PromptBuilder, sample_requests
    from kvshard_bench.fidelity import in_list_contexts

    tokenizer = smollm2.tokenizer  # type: ignore[attr-defined]
    builder = PromptBuilder(tokenizer, movielens)  # type: ignore[arg-type]
    contexts = in_list_contexts(builder, tokenizer, 3, seed=0)
    assert contexts == in_list_contexts(builder, tokenizer, 3, seed=0) != in_list_contexts(builder, tokenizer, 3, 1)
    header = builder.candidates_segment.token_ids
    prompt = builder.build(sample_requests(movielens, 1, 5, 4, 0)[0]).prompt  # type: ignore[arg-type]
    label_b = prompt.segments[5].token_ids  # system, history, header, "A. ", item, "B. "
    for a, context in enumerate(contexts):
        assert context[: len(header)] == header
        assert len(context) > len(header) + 2 * (a + 1)
    assert contexts[0][-len(label_b):] == label_b  # the first appearance puts the item behind "B. "
    assert tokenizer.decode(list(contexts[0])).startswith("\nCandidates:\nA. ")


def test_with_labels_after_items_benchmark_contexts_end_on_a_label_and_neutral_text_on_the_header(
        smollm2: object, movielens: object) -> None:
    from kvshard.prompts import PromptBuilder, PromptTemplate
    from kvshard_bench.fidelity import in_list_contexts, neutral_text

    tokenizer = smollm2.tokenizer  # type: ignore[attr-defined]
    template = PromptTemplate(label_position="after")
    builder = PromptBuilder(tokenizer, movielens, template=template)  # type: ignore[arg-type]
    first = tokenizer.decode(list(in_list_contexts(builder, tokenizer, 2, seed=0)[0]))
    assert first.startswith("\nCandidates:\n") and first.endswith(" [A]\n") and "[B]" not in first
    assert neutral_text(template, None) == "\nCandidates:\n"
    assert neutral_text(PromptTemplate(), None) == "\nCandidates:\nA. " and neutral_text(template, "x") == "x"


def test_an_engine_that_defaults_to_averaged_blocks_still_measures_prefix_reuse() -> None:
    engine = BlendEngine(tiny_model("llama"), TINY_IDENTITY, settings=averaged())
    prompt = tiny_prompt()
    prefix = engine.prefix(prompt)
    torch.testing.assert_close(prefix.logits, engine.full(prompt).logits, atol=1e-5, rtol=1e-5)
    assert prefix.exact_prefix_tokens == len(prompt.segments[0]) + len(prompt.segments[1])
