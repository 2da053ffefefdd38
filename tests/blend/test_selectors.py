"""Selector contracts, on tensors alone: the suffix always stays, counts follow r, filtering narrows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshard_sidecar.engine.selectors import (
    Layout,
    boundary_positions,
    deviation_scores,
    keep_count,
    plan,
    select_boundary,
    select_none,
    select_top,
)
from kvshard_sidecar.engine.settings import BlendSettings, SettingsError

layouts = st.lists(st.integers(1, 12), min_size=3, max_size=10).flatmap(
    lambda sizes: st.tuples(st.just(sizes), st.integers(0, 1))
)


def make_layout(sizes: list[int], exact_segments: int, forced: list[int] | None = None) -> Layout:
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    exact = bounds[exact_segments - 1][1] if exact_segments else 0
    return Layout.build(bounds, exact, forced if forced is not None else [len(sizes) - 1])


def suffix(layout: Layout) -> set[int]:
    start, end = layout.segment_bounds[-1]
    return set(range(start, end))


@settings(max_examples=80, deadline=None)
@given(spec=layouts, ratio=st.floats(0, 1), selector=st.sampled_from(["none", "boundary", "deviation", "hybrid"]))
def test_every_selector_always_keeps_the_suffix(spec: tuple[list[int], int], ratio: float, selector: str) -> None:
    sizes, exact = spec
    layout = make_layout(sizes, exact)
    steps = plan(layout, BlendSettings(selector=selector, ratio=ratio, check_layers=(1, 2),  # type: ignore[arg-type]
                                       schedule=(min(1.0, ratio * 2), ratio)))
    assert suffix(layout) <= set(steps.initial.tolist())
    scores = torch.rand(layout.num_tokens)
    running = steps.initial
    for step in steps.checks:
        running = running[select_top(scores[running], step.keep, steps.pinned[running])]
        assert suffix(layout) <= set(running.tolist())


@settings(max_examples=80, deadline=None)
@given(spec=layouts, ratio=st.floats(0, 1))
def test_deviation_count_matches_ratio_and_never_touches_the_exact_prefix(
    spec: tuple[list[int], int], ratio: float
) -> None:
    sizes, exact = spec
    layout = make_layout(sizes, exact)
    steps = plan(layout, BlendSettings(selector="deviation", ratio=ratio))
    scores = torch.rand(layout.num_tokens)
    running = steps.initial
    assert int(running.min()) >= layout.exact_prefix
    final = running[select_top(scores[running], steps.checks[-1].keep, steps.pinned[running])]
    expected = keep_count(ratio, layout.num_candidates) + len(suffix(layout))
    assert final.numel() == expected == steps.final_count()
    kept = set(final.tolist()) - suffix(layout)
    dropped = set(layout.candidates().tolist()) - kept
    if kept and dropped:  # the kept ones are the highest deviations
        assert min(scores[list(kept)]) >= max(scores[list(dropped)])


def test_keep_count_rounds_up_and_clamps() -> None:
    assert keep_count(0.15, 100) == 15
    assert keep_count(0.151, 100) == 16
    assert keep_count(0.0, 100) == 0
    assert keep_count(1.0, 7) == 7


def test_gradual_schedule_narrows_and_each_set_is_chosen_from_the_previous() -> None:
    layout = make_layout([5, 10, 3, 20, 3, 20, 6], 1)
    steps = plan(layout, BlendSettings(selector="deviation", ratio=0.1, check_layers=(1, 2, 3),
                                       schedule=(0.5, 0.25, 0.1)))
    keeps = [s.keep for s in steps.checks]
    assert keeps == sorted(keeps, reverse=True) and keeps[0] > keeps[-1]
    running = steps.initial
    sets = [set(running.tolist())]
    for step in steps.checks:
        scores = torch.rand(running.numel())
        running = running[select_top(scores, step.keep, steps.pinned[running])]
        sets.append(set(running.tolist()))
    assert all(later <= earlier for earlier, later in zip(sets, sets[1:], strict=False))
    assert [len(s) for s in sets[1:]] == [k + len(suffix(layout)) for k in keeps]


def test_schedule_that_widens_or_misses_the_ratio_is_refused() -> None:
    with pytest.raises(SettingsError, match="narrow"):
        BlendSettings(check_layers=(1, 2), schedule=(0.1, 0.3), ratio=0.3).validate()
    with pytest.raises(SettingsError, match="end at ratio"):
        BlendSettings(check_layers=(1, 2), schedule=(0.3, 0.2), ratio=0.15).validate()
    with pytest.raises(SettingsError, match="start at 1"):
        BlendSettings(check_layers=(0,)).validate()
    with pytest.raises(SettingsError, match="beyond"):
        BlendSettings(check_layers=(1, 40)).validate(num_layers=30)


def test_none_selects_only_the_forced_tokens() -> None:
    layout = make_layout([4, 6, 2, 5, 3], 2, forced=[2, 4])
    assert select_none(layout).tolist() == [10, 11, 17, 18, 19]


def test_boundary_takes_the_first_w_tokens_of_each_segment_after_the_exact_prefix() -> None:
    layout = make_layout([4, 6, 2, 5, 3], 1)
    assert boundary_positions(layout, 2).tolist() == [4, 5, 10, 11, 12, 13]
    assert select_boundary(layout, 1).tolist() == [4, 10, 12, 17, 18, 19]


@settings(max_examples=60, deadline=None)
@given(spec=layouts, ratio=st.floats(0, 1))
def test_boundary_spends_exactly_the_ratio_budget_on_segment_starts(spec: tuple[list[int], int], ratio: float) -> None:
    sizes, exact = spec
    layout = make_layout(sizes, exact)
    chosen = plan(layout, BlendSettings(selector="boundary", ratio=ratio)).initial
    budget = keep_count(ratio, layout.num_candidates)
    assert chosen.numel() == budget + len(suffix(layout))
    picked = sorted(set(chosen.tolist()) - suffix(layout))
    offsets = {p: p - max(s for s, _ in layout.segment_bounds if s <= p) for p in layout.candidates().tolist()}
    if picked and len(picked) < layout.num_candidates:  # nothing left out starts earlier in its segment
        left_out = set(offsets) - set(picked)
        assert max(offsets[p] for p in picked) <= min(offsets[p] for p in left_out)


def test_hybrid_pins_segment_starts_and_fills_the_rest_by_deviation() -> None:
    layout = make_layout([4, 6, 2, 5, 3], 1)
    steps = plan(layout, BlendSettings(selector="hybrid", ratio=0.5, boundary_w=1))
    edges = boundary_positions(layout, 1)
    assert edges.numel() <= keep_count(0.5, layout.num_candidates)
    assert steps.pinned[edges].all()
    assert steps.checks[-1].keep == keep_count(0.5, layout.num_candidates) - edges.numel()
    assert steps.final_count() == keep_count(0.5, layout.num_candidates) + 3


def test_deviation_scores_follow_the_configured_tensor() -> None:
    k, v = torch.zeros(2, 4, 8), torch.zeros(2, 4, 8)
    fresh_k, fresh_v = k.clone(), v.clone()
    fresh_k[:, 1] += 1.0  # token 1 deviates in K only
    fresh_v[:, 2] += 3.0  # token 2 deviates in V only
    assert int(deviation_scores(fresh_k, k, fresh_v, v, "k").argmax()) == 1
    assert int(deviation_scores(fresh_k, k, fresh_v, v, "v").argmax()) == 2
    both = deviation_scores(fresh_k, k, fresh_v, v, "kv")
    assert both[1] > 0 and both[2] > 0 and both[0] == 0 and both[3] == 0


def _causal(rows: list[int], total: int) -> torch.Tensor:
    return torch.arange(total)[None, :] <= torch.tensor(rows)[:, None]


def test_attention_received_is_a_probability_mass_over_the_visible_rows() -> None:
    from kvshard_sidecar.engine.selectors import attention_received

    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(4, 3, 8, generator=generator)  # 4 heads sharing 2 kv heads
    keys = torch.randn(2, 10, 8, generator=generator)
    received = attention_received(queries, keys, _causal([5, 8, 9], 10), scale=8**-0.5)
    assert received.shape == (10,)
    torch.testing.assert_close(received.sum(), torch.tensor(1.0))
    early = attention_received(queries[:, :1], keys, _causal([5], 10), scale=8**-0.5)
    assert bool((early[6:] == 0).all()) and bool((early[:6] > 0).all())
    blocked = _causal([9], 10)
    blocked[0, 3:7] = False  # another candidate's rows
    hidden = attention_received(queries[:, :1], keys, blocked, scale=8**-0.5)
    assert bool((hidden[3:7] == 0).all()) and bool((hidden[7:] > 0).all())
