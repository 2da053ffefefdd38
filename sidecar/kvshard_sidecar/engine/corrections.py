"""Training-free corrections of *which* rows a budgeted selector recomputes (pure functions).

Why they exist (FINDINGS.md, 2026-12-01): on recommendation prompts the count of fresh rows matters
less than their shape. Fresh labels beside stale items are worse than all stale; deviation at layer 1
ranks exactly those label tokens first; rows close to the question matter most; and items + labels +
header made exact give full prefill's answer. So a selector's ranking (boundary order, position, or
deviation at the check layer) is reshaped before its budget is spent:

* **tail weighting** — priority ``(1 − w)·rank(score) + w·closeness``, closeness growing linearly
  from the first blendable row (0) to the last (1): the rows just before the question win ties;
* **structure-aware** — the list header first (behind an exact prefix its fresh KV *is* exact), and a
  label recomputed exactly when some of its item is, so a label and its item are never mixed;
* **labels first** — every candidate's label before anything else (closest to the question first),
  then the selector's picks: with the label after its item a fine-tuned model's answer is read from
  the label rows, and only fresh ones have seen their item (``--attribution`` on that model);
* **segment-granular** — the budget goes to whole units (label + item, the header, the history) in
  order of their mean priority; a unit that does not fit is skipped, so none is half fresh.

Each correction only reorders or groups picks within ``keep``: at r = 1 every candidate is picked
(a full prefill), and switched off the selector's own top-k is used unchanged (tests pin both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshard_sidecar.engine.selectors import ROLE_HEADER, ROLE_LABEL, Layout, boundary_order, select_top
from kvshard_sidecar.engine.settings import BlendSettings


def rank01(scores: torch.Tensor) -> torch.Tensor:
    """Each score's rank scaled to ``[0, 1]`` (highest score → 1; ties by position, later first)."""
    n = int(scores.numel())
    order = torch.argsort(scores.double() + torch.arange(n, dtype=torch.float64) * 1e-12, stable=True)
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = torch.arange(n, dtype=torch.float64) / max(1, n - 1)
    return ranks


def closeness(positions: torch.Tensor, layout: Layout) -> torch.Tensor:
    """How close each position is to the question: 0 at the exact prefix's end, 1 at the last row."""
    span = max(1, layout.num_tokens - 1 - layout.exact_prefix)
    return ((positions.double().cpu() - layout.exact_prefix) / span).clamp(0.0, 1.0)


def static_scores(layout: Layout, selector: str, candidates: torch.Tensor) -> torch.Tensor:
    """Scores that rank ``candidates`` as a static selector would pick them (higher = earlier)."""
    if selector == "tail":
        return candidates.double()
    order = boundary_order(layout)
    rank = torch.empty(layout.num_tokens, dtype=torch.float64)
    rank[order] = -torch.arange(order.numel(), dtype=torch.float64)
    return rank[candidates]


@dataclass(frozen=True)
class Picker:
    """Picks ``keep`` of the not-pinned entries of ``positions`` by priority, with the corrections on."""

    layout: Layout
    settings: BlendSettings

    def __call__(self, scores: torch.Tensor, keep: int, pinned: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """Indices into ``positions`` (sorted): every pinned one plus the picked ones."""
        positions = positions.cpu()
        pinned = pinned.cpu()
        priority = self.priority(scores.detach().cpu(), positions)
        if self.settings.labels_first:  # labels are spent first, then held like pinned rows
            labels = self._labels(keep, pinned, positions)
            keep -= len(labels)
            pinned = pinned.clone()
            pinned[labels] = True
        if self.settings.granularity == "segment":
            picked = self._segments(priority, keep, pinned, positions)
        elif self.settings.structure:
            picked = self._structured(priority, keep, pinned, positions)
        else:
            return select_top(priority, keep, pinned).to(scores.device)
        chosen = torch.nonzero(pinned).reshape(-1).tolist() + picked
        return torch.tensor(sorted(set(chosen)), dtype=torch.long, device=scores.device)

    def priority(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        w = self.settings.tail_weight
        if w <= 0:
            return scores.double()
        return (1 - w) * rank01(scores) + w * closeness(positions, self.layout)

    def _labels(self, keep: int, pinned: torch.Tensor, positions: torch.Tensor) -> list[int]:
        """The not-pinned label rows, the last (closest to the question) first, at most ``keep``."""
        _, roles = self._units(positions)
        labels = [i for i in range(len(roles)) if roles[i] == ROLE_LABEL and not bool(pinned[i])]
        return sorted(labels, key=lambda i: -int(positions[i]))[:max(0, keep)]

    def _units(self, positions: torch.Tensor) -> tuple[list[int], list[int]]:
        assert self.layout.units is not None and self.layout.roles is not None
        return self.layout.units[positions].tolist(), self.layout.roles[positions].tolist()

    def _segments(self, priority: torch.Tensor, keep: int, pinned: torch.Tensor,
                  positions: torch.Tensor) -> list[int]:
        """Whole units by mean priority, skipping those that no longer fit the budget."""
        units, _ = self._units(positions)
        members: dict[int, list[int]] = {}
        for index, unit in enumerate(units):
            if not bool(pinned[index]):
                members.setdefault(unit, []).append(index)
        ranked = sorted(members, key=lambda u: (-float(priority[members[u]].mean()), -u))
        picked: list[int] = []
        for unit in ranked:
            if len(members[unit]) <= keep - len(picked):
                picked += members[unit]
        return picked

    def _structured(self, priority: torch.Tensor, keep: int, pinned: torch.Tensor,
                    positions: torch.Tensor) -> list[int]:
        """Header first; then tokens by priority, each unit's label joining its first picked token (a
        token whose label no longer fits is skipped)."""
        units, roles = self._units(positions)
        free = [i for i in range(len(units)) if not bool(pinned[i])]
        labels: dict[int, list[int]] = {}
        for i in free:
            if roles[i] == ROLE_LABEL:
                labels.setdefault(units[i], []).append(i)
        picked: list[int] = []
        header = [i for i in free if roles[i] == ROLE_HEADER]
        if header and len(header) <= keep:
            picked += header
        joined: set[int] = set()
        order = sorted((i for i in free if roles[i] not in (ROLE_LABEL, ROLE_HEADER)),
                       key=lambda i: (-float(priority[i]), -i))
        for i in order:
            room = keep - len(picked)
            if room <= 0:
                break
            label = [] if units[i] in joined else labels.get(units[i], [])
            if 1 + len(label) > room:
                continue
            picked += [i, *label]
            joined.add(units[i])
        return picked  # may leave up to a label's length unspent rather than split a label from its item
