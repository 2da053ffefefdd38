"""Named baselines match their definitions; every correction is full at r = 1 and its plain selector off.

Run on tiny random models (no weights): the properties are about which rows are recomputed and what
the layer loop does with them, not about SmolLM2's answers.
"""

from __future__ import annotations

import pytest
import torch
from blend_helpers import TINY_IDENTITY, tiny_model, tiny_prompt

from kvshard.segments import Prompt, Segment, SegmentKind
from kvshard_sidecar.engine import BlendEngine, BlendSettings, SettingsError
from kvshard_sidecar.engine.calibration import calibrated_attention, stale_rows
from kvshard_sidecar.engine.corrections import Picker, rank01
from kvshard_sidecar.engine.methods import METHODS, method_settings
from kvshard_sidecar.engine.selectors import (
    ROLE_HEADER,
    ROLE_LABEL,
    ROLE_PLAIN,
    Layout,
    deviation_scores,
    keep_count,
    plan,
    segment_units,
)

# system, history, header, then label/item pairs, instruction: the real prompt's shape
SIZES = (6, 9, 3, 2, 5, 2, 7, 2, 6, 4)
CORRECTIONS = [{"tail_weight": 0.5}, {"tail_weight": 1.0}, {"structure": True}, {"granularity": "segment"},
               {"structure": True, "tail_weight": 0.5}, {"attention_temperature": 1.3, "attention_scale": 0.6}]


def list_prompt(seed: int = 1) -> Prompt:
    generator = torch.Generator().manual_seed(seed)
    kinds = [SegmentKind.SYSTEM, SegmentKind.HISTORY, SegmentKind.FREE]
    kinds += [SegmentKind.FREE, SegmentKind.ITEM] * 3 + [SegmentKind.INSTRUCTION]
    return Prompt.of(Segment(kind, tuple(torch.randint(3, 97, (n,), generator=generator).tolist()))
                     for kind, n in zip(kinds, SIZES, strict=True))


def layout_of(prompt: Prompt, exact_prefix: int) -> Layout:
    return BlendEngine.layout(prompt, exact_prefix, BlendSettings())


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    return BlendEngine(tiny_model("llama", seed=3), TINY_IDENTITY)


def test_layout_pairs_each_label_with_the_item_after_it() -> None:
    prompt = list_prompt()
    layout = layout_of(prompt, 6)
    assert layout.units is not None and layout.roles is not None
    spans = prompt.spans
    assert set(layout.roles[spans[2].start:spans[2].end].tolist()) == {ROLE_HEADER}
    for label, item in ((3, 4), (5, 6), (7, 8)):
        assert set(layout.roles[spans[label].start:spans[label].end].tolist()) == {ROLE_LABEL}
        assert set(layout.units[spans[label].start:spans[item].end].tolist()) == {item}


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("context", ["standalone", "system"])
def test_epic_recomputes_exactly_the_first_k_tokens_of_every_block(engine: BlendEngine, k: int, context: str) -> None:
    prompt = list_prompt()
    settings = method_settings("epic", 0.2).with_(epic_k=k, prefill_context=context)
    result = engine.blend(prompt, settings)
    spans = prompt.spans
    exact = result.exact_prefix_tokens
    expected = {p for s in spans[:-1] if s.start >= exact for p in range(s.start, min(s.end, s.start + k))}
    expected |= set(range(spans[-1].start, spans[-1].end))
    assert set(result.selected.tolist()) == expected


def test_epic_derives_k_from_the_ratio_and_is_full_at_one(engine: BlendEngine) -> None:
    prompt = list_prompt()
    full = engine.full(prompt)
    assert method_settings("epic", 0.5).prefill_context == "standalone"
    low = engine.blend(prompt, method_settings("epic", 0.2))
    layout = layout_of(prompt, low.exact_prefix_tokens)
    assert low.recomputed_tokens - len(prompt.segments[-1]) <= keep_count(0.2, layout.num_candidates)
    one = engine.blend(prompt, method_settings("epic", 1.0))
    torch.testing.assert_close(one.logits, full.logits, atol=1e-5, rtol=1e-5)


def test_cacheblend_is_k_deviation_top_r_at_layer_one_on_standalone_blocks(engine: BlendEngine) -> None:
    prompt = list_prompt()
    settings = method_settings("cacheblend", 0.3)
    assert (settings.prefill_context, settings.check_layers, settings.schedule) == ("standalone", (1,), ())
    result = engine.blend(prompt, settings)
    # recompute CacheBlend by hand: layers 0 and 1 for every blendable row, top-r by ‖K_fresh − K_cached‖
    assembled = engine.blend(prompt, method_settings("none", 0.0).with_(prefill_context="standalone"))
    cached_k = assembled.kv.keys[1].clone()  # 'none' leaves cached rows in place (only the suffix is fresh)
    full = engine.full(prompt)
    exact = result.exact_prefix_tokens
    layout = layout_of(prompt, exact)
    # every row up to layer 1 is exact when all of them run: full's layer-1 keys are the fresh ones
    scores = deviation_scores(full.kv.keys[1], cached_k, full.kv.values[1], full.kv.values[1], "k")
    candidates = layout.candidates()
    keep = int(torch.tensor(0.3 * candidates.numel()).ceil())
    top = candidates[torch.topk(scores[candidates], keep).indices]
    expected = set(top.tolist()) | set(layout.forced_positions().tolist())
    assert set(result.selected.tolist()) == expected


def test_cacheblend_refuses_gradual_filtering() -> None:
    with pytest.raises(SettingsError, match="schedule"):
        BlendSettings(selector="cacheblend", check_layers=(1, 2), schedule=(0.3, 0.15)).validate()


@pytest.mark.parametrize("name", METHODS)
def test_every_named_method_at_ratio_one_is_full_except_none(engine: BlendEngine, name: str) -> None:
    prompt = list_prompt()
    full = engine.full(prompt)
    result = engine.blend(prompt, method_settings(name, 1.0))
    gap = float((result.logits - full.logits).abs().max())
    assert (gap > 1e-3) if name == "none" else (gap < 1e-4)


@pytest.mark.parametrize("selector", ["boundary", "deviation", "tail"])
@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("context", ["standalone", "system"])
def test_every_correction_at_ratio_one_reproduces_full(engine: BlendEngine, selector: str,
                                                       correction: dict[str, object], context: str) -> None:
    prompt = list_prompt()
    full = engine.full(prompt)
    settings = BlendSettings(selector=selector, ratio=1.0, prefill_context=context).with_(**correction)  # type: ignore[arg-type]
    result = engine.blend(prompt, settings)
    torch.testing.assert_close(result.logits, full.logits, atol=1e-5, rtol=1e-5)
    n = result.num_tokens
    torch.testing.assert_close(result.kv.values[:, :, :n], full.kv.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("selector", ["boundary", "deviation", "tail"])
def test_corrections_switched_off_are_the_plain_selector(engine: BlendEngine, selector: str) -> None:
    prompt = list_prompt()
    plain = BlendSettings(selector=selector, ratio=0.3)  # type: ignore[arg-type]
    off = plain.with_(tail_weight=0.0, structure=False, granularity="token", attention_temperature=1.0,
                      attention_scale=1.0)
    a, b = engine.blend(prompt, plain), engine.blend(prompt, off)
    assert torch.equal(a.selected, b.selected) and torch.equal(a.logits, b.logits)
    # and a correction switched on does change the blend, so the equality above can fail
    on = engine.blend(prompt, plain.with_(attention_temperature=1.5, attention_scale=0.5))
    assert not torch.equal(on.logits, a.logits)


def test_tail_weight_one_picks_the_rows_closest_to_the_question(engine: BlendEngine) -> None:
    prompt = list_prompt()
    for selector in ("boundary", "deviation"):
        picked = engine.blend(prompt, BlendSettings(selector=selector, ratio=0.4, tail_weight=1.0))  # type: ignore[arg-type]
        tail = engine.blend(prompt, BlendSettings(selector="tail", ratio=0.4))
        assert torch.equal(picked.selected, tail.selected)


def test_structure_never_recomputes_a_label_without_its_item_and_starts_with_the_header(engine: BlendEngine) -> None:
    prompt = list_prompt()
    spans = prompt.spans
    for selector in ("boundary", "deviation", "tail"):
        for ratio in (0.1, 0.2, 0.3, 0.5):
            result = engine.blend(prompt, BlendSettings(selector=selector, ratio=ratio, structure=True))  # type: ignore[arg-type]
            chosen = set(result.selected.tolist())
            layout = layout_of(prompt, result.exact_prefix_tokens)
            assert len(chosen) - len(prompt.segments[-1]) <= keep_count(ratio, layout.num_candidates)
            assert set(range(spans[2].start, spans[2].end)) <= chosen  # the header fits every budget here
            for label, item in ((3, 4), (5, 6), (7, 8)):
                label_rows = set(range(spans[label].start, spans[label].end))
                item_fresh = bool(chosen & set(range(spans[item].start, spans[item].end)))
                assert (label_rows <= chosen) == item_fresh and (not (label_rows & chosen) or item_fresh)


def test_labels_first_spends_the_budget_on_every_label_before_anything_else(engine: BlendEngine) -> None:
    prompt = list_prompt()  # system, history, header, then label/item three times, instruction
    spans = prompt.spans
    labels = [set(range(spans[i].start, spans[i].end)) for i in (3, 5, 7)]
    for selector in ("boundary", "deviation", "tail"):
        for ratio in (0.1, 0.3, 0.6):
            result = engine.blend(prompt, BlendSettings(selector=selector, ratio=ratio, labels_first=True))  # type: ignore[arg-type]
            layout = layout_of(prompt, result.exact_prefix_tokens)
            budget = keep_count(ratio, layout.num_candidates)
            chosen = set(result.selected.tolist()) - set(range(spans[-1].start, spans[-1].end))
            label_rows = sorted(set().union(*labels), reverse=True)
            assert len(chosen) <= budget
            # the labels closest to the question first; only when every label fits does anything else get picked
            assert set(label_rows[:budget]) <= chosen
            assert chosen <= set(label_rows) or set(label_rows) <= chosen
    assert method_settings("tail+labels", 0.2).labels_first and not method_settings("tail", 0.2).labels_first


def test_segment_granularity_recomputes_whole_units_only(engine: BlendEngine) -> None:
    prompt = list_prompt()
    for selector in ("boundary", "deviation", "tail"):
        for ratio in (0.2, 0.4, 0.6):
            result = engine.blend(prompt, BlendSettings(selector=selector, ratio=ratio, granularity="segment"))  # type: ignore[arg-type]
            layout = layout_of(prompt, result.exact_prefix_tokens)
            assert layout.units is not None
            chosen = torch.zeros(len(prompt), dtype=torch.bool)
            chosen[result.selected] = True
            blendable = torch.arange(len(prompt)) >= result.exact_prefix_tokens
            for unit in layout.units[blendable].unique().tolist():
                rows = chosen[(layout.units == unit) & blendable]
                assert bool(rows.all()) or not bool(rows.any())
            assert int(chosen.sum()) - len(prompt.segments[-1]) <= keep_count(ratio, layout.num_candidates)


def test_segment_pick_orders_units_by_mean_priority() -> None:
    prompt = list_prompt()
    layout = layout_of(prompt, 15)  # system + history exact
    picker = Picker(layout, BlendSettings(selector="deviation", granularity="segment"))
    candidates = layout.candidates()
    scores = torch.zeros(candidates.numel())
    last_item = prompt.spans[8]
    scores[(candidates >= last_item.start) & (candidates < last_item.end)] = 5.0
    chosen = candidates[picker(scores, 8, torch.zeros(candidates.numel(), dtype=torch.bool), candidates)]
    assert set(chosen.tolist()) == set(range(prompt.spans[7].start, last_item.end))  # label + item, 8 rows


def test_rank01_keeps_the_order_of_scores() -> None:
    scores = torch.tensor([0.5, -2.0, 9.0, 0.1])
    assert rank01(scores).tolist() == [2 / 3, 0.0, 1.0, 1 / 3]


def test_calibrated_attention_divides_stale_logits_and_scales_their_weight() -> None:
    torch.manual_seed(0)
    q, keys = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 6, 8)
    values = torch.randn(1, 2, 6, 8)
    running = torch.tensor([3, 4, 5])
    mask = torch.arange(6)[None, :] <= running[:, None]
    stale = stale_rows(6, running, exact_prefix=1)
    assert stale.tolist() == [False, True, True, False, False, False]
    scaled, bias = calibrated_attention(keys, mask, stale, 2.0, 0.5)
    got = torch.nn.functional.scaled_dot_product_attention(q, scaled, values, attn_mask=bias, scale=1.0)
    logits = q @ keys.transpose(-1, -2)
    logits[..., stale] = logits[..., stale] / 2.0 + torch.log(torch.tensor(0.5))
    expected = logits.masked_fill(~mask, float("-inf")).softmax(-1) @ values
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_pick_corrections_refuse_selectors_without_a_budgeted_ranking() -> None:
    for selector in ("none", "hybrid", "cacheblend", "epic"):
        with pytest.raises(SettingsError, match="reshape"):
            BlendSettings(selector=selector, structure=True).validate()  # type: ignore[arg-type]


def test_method_specs_apply_corrections_and_need_a_calibration_for_ape() -> None:
    settings = method_settings("deviation+structure+tail", 0.2)
    assert (settings.selector, settings.structure, settings.tail_weight) == ("deviation", True, 0.5)
    assert method_settings("tail+segment", 0.2).granularity == "segment"
    with pytest.raises(ValueError, match="calibration"):
        method_settings("none+ape", 0.0)
    ape = method_settings("none+ape", 0.0, calibration=(1.2, 0.8))
    assert (ape.attention_temperature, ape.attention_scale) == (1.2, 0.8)
    with pytest.raises(ValueError, match="unknown"):
        method_settings("deviation+magic", 0.2)


def test_default_prompt_plan_is_unchanged_by_the_new_fields() -> None:
    prompt = tiny_prompt()
    layout = BlendEngine.layout(prompt, 6, BlendSettings())
    assert plan(layout, BlendSettings(selector="boundary", ratio=0.3)).picker is None


def test_with_labels_after_their_items_each_label_joins_the_item_before_it() -> None:
    kinds = ["system", "history", "free", "item", "free", "item", "free", "item", "free", "instruction"]
    units, roles = segment_units(kinds)
    assert roles[2] == ROLE_HEADER
    for item, label in ((3, 4), (5, 6), (7, 8)):
        assert (roles[label], units[label]) == (ROLE_LABEL, item)
    before = ["system", "history", "free", "free", "item", "free", "item", "instruction"]
    assert segment_units(before) == ([0, 1, 2, 4, 4, 6, 6, 7],
                                     [ROLE_PLAIN, ROLE_PLAIN, ROLE_HEADER, ROLE_LABEL, ROLE_PLAIN, ROLE_LABEL,
                                      ROLE_PLAIN, ROLE_PLAIN])
