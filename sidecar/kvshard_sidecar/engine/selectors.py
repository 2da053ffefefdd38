"""Which token positions are recomputed: the selectors, as pure functions.

How they fit a blend: docs/blending-and-fidelity.md#how-a-blend-works.

Everything here works on integers and tensors only — no model, no store — so each contract (the
suffix is always selected, counts follow the ratio, gradual filtering narrows) is tested on its own.

Vocabulary:

* **exact prefix** — tokens ``[0, P)`` whose cached KV *is* what a full prefill computes (the first
  segment at offset 0, and in ``system`` prefill mode the segment right after it). They are never
  recomputed: a prefix cache would not recompute them either.
* **forced** — tokens always recomputed: the uncached suffix (and FREE segments if configured).
* **candidates** — every other token; ratios are shares of the candidates.
* **pinned** — tokens a check layer may not drop (forced, plus boundary tokens for ``hybrid``).
* **units** — what a segment-granular or structure-aware pick keeps together: a label and the item
  it names form one unit; the header, the history and every other segment are units of their own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvshard_sidecar.engine.settings import BlendSettings, DeviationOn, DeviationWeight

if TYPE_CHECKING:
    from kvshard_sidecar.engine.corrections import Picker

ROLE_PLAIN, ROLE_LABEL, ROLE_HEADER = 0, 1, 2


@dataclass(frozen=True)
class Layout:
    """Token roles of one prompt.

    Attributes:
        segment_bounds: ``(start, end)`` of every segment, in order.
        exact_prefix: number of leading tokens with exact cached KV.
        forced: bool ``[N]``: tokens always recomputed (at or after the exact prefix).
        units: long ``[N]``: the unit (index of its representative segment) of every token.
        roles: long ``[N]``: ``ROLE_LABEL`` for a label's tokens, ``ROLE_HEADER`` for a list header's
            (a FREE segment not followed by an item), ``ROLE_PLAIN`` for everything else.
        answer_blocks: ``(start, end)`` of each span whose own end is where an answer is read — the
            isolated scorer's candidates; empty: the answer is read after the whole prompt.
    """

    segment_bounds: tuple[tuple[int, int], ...]
    exact_prefix: int
    forced: torch.Tensor
    units: torch.Tensor | None = None
    roles: torch.Tensor | None = None
    answer_blocks: tuple[tuple[int, int], ...] = ()

    @classmethod
    def build(
        cls, segment_bounds: Sequence[tuple[int, int]], exact_prefix: int, forced_segments: Sequence[int],
        kinds: Sequence[str] | None = None,
    ) -> Layout:
        """A layout whose forced tokens are the whole segments with the given indices; ``kinds`` (the
        segments' kind values) give the units and roles (each segment its own plain unit without them)."""
        bounds = tuple((int(s), int(e)) for s, e in segment_bounds)
        total = bounds[-1][1] if bounds else 0
        forced = torch.zeros(total, dtype=torch.bool)
        for index in forced_segments:
            start, end = bounds[index]
            forced[max(start, exact_prefix):end] = True
        unit_of, role_of = segment_units(kinds if kinds is not None else ["item"] * len(bounds))
        lengths = torch.tensor([end - start for start, end in bounds], dtype=torch.long)
        units = torch.repeat_interleave(torch.tensor(unit_of, dtype=torch.long), lengths)
        roles = torch.repeat_interleave(torch.tensor(role_of, dtype=torch.long), lengths)
        return cls(bounds, exact_prefix, forced, units, roles)

    @property
    def num_tokens(self) -> int:
        return int(self.forced.shape[0])

    def blendable(self) -> torch.Tensor:
        """Positions at or after the exact prefix (forced or candidate), sorted."""
        return torch.arange(self.exact_prefix, self.num_tokens)

    def forced_positions(self) -> torch.Tensor:
        return torch.nonzero(self.forced).reshape(-1)

    def candidates(self) -> torch.Tensor:
        mask = ~self.forced
        mask[: self.exact_prefix] = False
        return torch.nonzero(mask).reshape(-1)

    @property
    def num_candidates(self) -> int:
        return int(self.candidates().numel())


def segment_units(kinds: Sequence[str]) -> tuple[list[int], list[int]]:
    """Per segment: its unit (a label joins the item after it) and its role (label, header or plain).

    Labels and headers are the FREE segments (kvshard's prompts put ``"A. "`` in its own segment so an
    item's block is the same whatever letter it gets). With the label before its item (the default
    template) a FREE segment followed by an ITEM is that item's label; with the label after it
    (``labelPosition: after``, recognised by a FREE segment right after the last ITEM) a FREE
    segment right after an ITEM is. Any other FREE segment is a header.
    """
    units, roles = list(range(len(kinds))), [ROLE_PLAIN] * len(kinds)
    items = [i for i, kind in enumerate(kinds) if kind == "item"]
    after = bool(items) and items[-1] + 1 < len(kinds) and kinds[items[-1] + 1] == "free"
    step = -1 if after else 1
    for index, kind in enumerate(kinds):
        if kind != "free":
            continue
        if 0 <= index + step < len(kinds) and kinds[index + step] == "item":
            units[index], roles[index] = index + step, ROLE_LABEL
        else:
            roles[index] = ROLE_HEADER
    return units, roles


def keep_count(ratio: float, candidates: int) -> int:
    """How many candidates a ratio keeps: ``ceil(ratio · candidates)``, within ``[0, candidates]``."""
    return max(0, min(candidates, math.ceil(ratio * candidates - 1e-9)))


def union(*positions: torch.Tensor) -> torch.Tensor:
    """Sorted unique union of position tensors."""
    joined = torch.cat([p.reshape(-1).to(torch.long) for p in positions]) if positions else torch.empty(0)
    unique: torch.Tensor = torch.unique(joined, sorted=True)
    return unique


def select_none(layout: Layout) -> torch.Tensor:
    """``none`` (PromptCache-style full reuse): only the forced tokens."""
    return layout.forced_positions()


def boundary_positions(layout: Layout, w: int) -> torch.Tensor:
    """The first ``w`` candidate tokens of every segment after the exact prefix (RcLLM's correction)."""
    picked = []
    for start, end in layout.segment_bounds:
        lo = max(start, layout.exact_prefix)
        if lo >= end or lo != start:
            continue
        span = torch.arange(start, min(end, start + w))
        picked.append(span[~layout.forced[span]])
    return union(*picked) if picked else torch.empty(0, dtype=torch.long)


def boundary_order(layout: Layout) -> torch.Tensor:
    """Candidates ordered by their offset inside their segment (then by position).

    Taking a prefix of this order of length ``k`` picks the first token of every blended segment, then
    the second of each, and so on: the boundary correction for a budget of ``k`` tokens, exactly.
    """
    candidates = layout.candidates()
    starts = torch.tensor([start for start, _ in layout.segment_bounds], dtype=torch.long)
    owner = torch.searchsorted(starts, candidates, right=True) - 1
    offset = candidates - starts[owner]
    order = torch.argsort(offset * (layout.num_tokens + 1) + candidates)
    return candidates[order]


def boundary_budget(layout: Layout, budget: int, w: int | None = None) -> torch.Tensor:
    """The first ``budget`` tokens of :func:`boundary_order` (only offsets ``< w`` if ``w`` is given)."""
    order = boundary_order(layout)
    if w is not None:
        starts = torch.tensor([start for start, _ in layout.segment_bounds], dtype=torch.long)
        owner = torch.searchsorted(starts, order, right=True) - 1
        order = order[(order - starts[owner]) < w]
    return union(order[: max(0, budget)])


def select_boundary(layout: Layout, w: int) -> torch.Tensor:
    """``boundary``: forced tokens plus the first ``w`` tokens of each blended segment."""
    return union(layout.forced_positions(), boundary_positions(layout, w))


def select_tail(layout: Layout, budget: int) -> torch.Tensor:
    """``tail``: forced tokens plus the last ``budget`` candidates (the rows closest to the question).

    With ``answer_blocks`` (the isolated scorer) the rows closest to *each* answer: every block keeps
    its own last ``budget × its share of the candidates`` rows, so what a candidate recomputes depends
    on its own length only, never on where the order put it."""
    candidates = layout.candidates()
    if layout.answer_blocks:
        total = max(1, int(candidates.numel()))
        picked = []
        for start, end in layout.answer_blocks:
            own = candidates[(candidates >= start) & (candidates < end)]
            keep = min(int(own.numel()), round(budget * int(own.numel()) / total))
            picked.append(own[own.numel() - keep:])
        return union(layout.forced_positions(), torch.cat(picked) if picked else candidates[:0])
    keep = max(0, min(budget, int(candidates.numel())))
    return union(layout.forced_positions(), candidates[candidates.numel() - keep:])


def epic_k_for(layout: Layout, budget: int) -> int:
    """The largest k whose first-k-of-every-block recompute fits ``budget`` candidates (0 if none does)."""
    longest = max((end - start for start, end in layout.segment_bounds), default=0)
    k = 0
    while k < longest and int(boundary_positions(layout, k + 1).numel()) <= budget:
        k += 1
    return k


def select_epic(layout: Layout, k: int) -> torch.Tensor:
    """``epic`` (EPIC's LegoLink): forced tokens plus the first ``k`` tokens of every blended block."""
    return union(layout.forced_positions(), boundary_positions(layout, k))


def deviation_scores(
    fresh_k: torch.Tensor,
    cached_k: torch.Tensor,
    fresh_v: torch.Tensor,
    cached_v: torch.Tensor,
    on: DeviationOn,
) -> torch.Tensor:
    """Per-token L2 deviation ‖fresh − cached‖ over ``[kv_heads, tokens, d]`` tensors → float32 ``[tokens]``.

    ``kv`` adds the K and V deviations, each divided by its mean so neither dominates by scale.
    """

    def norms(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
        diff = fresh.float() - cached.float()
        return diff.pow(2).sum(dim=(0, 2)).sqrt()

    if on == "k":
        return norms(fresh_k, cached_k)
    if on == "v":
        return norms(fresh_v, cached_v)
    dk, dv = norms(fresh_k, cached_k), norms(fresh_v, cached_v)
    return dk / dk.mean().clamp_min(1e-12) + dv / dv.mean().clamp_min(1e-12)


def attention_received(queries: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Mean attention probability each key row receives from ``queries``: float32 ``[N]``.

    ``queries`` ``[heads, s, d]``; ``keys`` ``[kv_heads, N, d]`` (grouped-query heads are shared);
    ``visible`` bool ``[s, N]``: the rows each query may see.
    """
    groups = queries.shape[0] // keys.shape[0]
    expanded = keys.float().repeat_interleave(groups, dim=0)
    logits = queries.float() @ expanded.transpose(1, 2) * scale
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    return probs.mean(dim=(0, 1))


def select_top(scores: torch.Tensor, keep: int, pinned: torch.Tensor) -> torch.Tensor:
    """Indices (into ``scores``) of every pinned entry plus the ``keep`` highest-scoring others, sorted."""
    free = torch.nonzero(~pinned).reshape(-1)
    keep = max(0, min(keep, int(free.numel())))
    top = free[torch.topk(scores[free], keep).indices] if keep else free[:0]
    return union(torch.nonzero(pinned).reshape(-1), top)


@dataclass(frozen=True)
class CheckStep:
    """At ``layer``, keep the pinned tokens plus ``keep`` others with the largest deviation."""

    layer: int
    keep: int


@dataclass(frozen=True)
class Plan:
    """What the layer loop runs: ``initial`` positions from layer 0, narrowed at each check step."""

    initial: torch.Tensor
    pinned: torch.Tensor  # bool [N]
    checks: tuple[CheckStep, ...]
    deviation_on: DeviationOn
    deviation_weight: DeviationWeight = "none"
    picker: Picker | None = None  # pick corrections at the check layers; None = plain top-k

    def final_count(self) -> int:
        if not self.checks:
            return int(self.initial.numel())
        return int(self.pinned[self.initial].sum()) + self.checks[-1].keep


def plan(layout: Layout, settings: BlendSettings) -> Plan:
    """Turn a selector's settings into a :class:`Plan` for ``layout``."""
    from kvshard_sidecar.engine.corrections import Picker, static_scores

    forced_only = layout.forced.clone()
    m = layout.num_candidates
    budget = keep_count(settings.ratio, m)
    if settings.selector == "none":
        return Plan(select_none(layout), forced_only, (), settings.deviation_on)
    if settings.selector == "epic":
        k = settings.epic_k if settings.epic_k is not None else epic_k_for(layout, budget)
        return Plan(select_epic(layout, k), forced_only, (), settings.deviation_on)
    if settings.selector == "cacheblend":
        steps = tuple(CheckStep(layer, budget) for layer in settings.check_layers)
        return Plan(layout.blendable(), forced_only, steps, "k", "none")
    picker = Picker(layout, settings) if settings.corrects_picks else None
    if picker is not None and settings.selector in ("boundary", "tail"):
        candidates = layout.candidates()
        chosen = picker(static_scores(layout, settings.selector, candidates), budget,
                        torch.zeros(candidates.numel(), dtype=torch.bool), candidates)
        return Plan(union(layout.forced_positions(), candidates[chosen]), forced_only, (), settings.deviation_on)
    if settings.selector == "tail":
        return Plan(select_tail(layout, budget), forced_only, (), settings.deviation_on)
    if settings.selector == "boundary":
        if settings.boundary_w is not None:
            return Plan(select_boundary(layout, settings.boundary_w), forced_only, (), settings.deviation_on)
        edges = boundary_budget(layout, keep_count(settings.ratio, m))
        return Plan(union(layout.forced_positions(), edges), forced_only, (), settings.deviation_on)
    pinned = forced_only
    reserved = 0
    if settings.selector == "hybrid":
        w = settings.boundary_w if settings.boundary_w is not None else 1
        edges = boundary_budget(layout, keep_count(settings.ratio, m), w)
        pinned = forced_only.clone()
        pinned[edges] = True
        reserved = int(edges.numel())
    steps = tuple(
        CheckStep(layer, max(0, keep_count(ratio, m) - reserved))
        for layer, ratio in zip(settings.check_layers, settings.ratios, strict=True)
    )
    return Plan(layout.blendable(), pinned, steps, settings.deviation_on, settings.deviation_weight, picker)

