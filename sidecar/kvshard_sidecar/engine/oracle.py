"""Oracle rows: full prefill's exact KV copied into a blend, to find where blending loses the answer.

Measurement only (``kvshard bench fidelity --attribution``). A blend whose stale rows of one kind
(the items, the labels, the header, ...) are replaced by full prefill's rows shows how much of the
error that kind carries; making every blended row exact for layers ``<= ℓ`` only shows at which
depth the error enters. The row sets are pure functions of the prompt, so the benchmark's table and
the tests name the same rows.

Label tokens are split by their offset inside the label (``"A. "`` is the letter, ``"."`` and
``" "`` on SmolLM2's tokenizer), because FINDINGS.md found the ``"."`` and ``" "`` rows the most
deviated and the ones whose freshness hurts. A label after its item (``" [A]\n"``: ``" ["``, the
letter, ``"]"``, ``"\n"``) maps the same way: its letter, the punctuation after the letter
(``label_dot``: ``"]"`` and the newline) and what comes before it (``label_space``: ``" ["``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvshard.segments import Prompt, SegmentKind
from kvshard_sidecar.engine.kvbuffer import KVBuffer
from kvshard_sidecar.engine.selectors import ROLE_HEADER, ROLE_LABEL, segment_units

PARTS = ("system", "history", "header", "labels", "label_letter", "label_dot", "label_space", "items",
         "instruction")
_KIND_PARTS = {"system": SegmentKind.SYSTEM, "history": SegmentKind.HISTORY, "items": SegmentKind.ITEM,
               "instruction": SegmentKind.INSTRUCTION}
_LABEL_OFFSETS = {"label_letter": (0, 1), "label_dot": (1, 2), "label_space": (2, 1 << 30)}
_LABEL_AFTER_OFFSETS = {"label_letter": (1, 2), "label_dot": (2, 1 << 30), "label_space": (0, 1)}


def part_rows(prompt: Prompt, parts: Iterable[str]) -> torch.Tensor:
    """Bool ``[N]``: the prompt's rows that belong to any of ``parts`` (names from :data:`PARTS`)."""
    wanted = set(parts)
    unknown = wanted - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    rows = torch.zeros(len(prompt), dtype=torch.bool)
    units, roles = segment_units([s.kind.value for s in prompt.segments])
    offsets = _LABEL_AFTER_OFFSETS if any(unit < index for index, unit in enumerate(units)) else _LABEL_OFFSETS
    for span, role in zip(prompt.spans, roles, strict=True):
        kind = span.segment.kind
        if any(kind is _KIND_PARTS[p] for p in wanted if p in _KIND_PARTS):
            rows[span.start:span.end] = True
        if role == ROLE_HEADER and "header" in wanted:
            rows[span.start:span.end] = True
        if role == ROLE_LABEL:
            if "labels" in wanted:
                rows[span.start:span.end] = True
            for name, (lo, hi) in offsets.items():
                if name in wanted:
                    rows[span.start + lo:min(span.end, span.start + hi)] = True
    return rows


@dataclass(frozen=True)
class Oracle:
    """Rows ``rows`` of layers ``0..upto_layer`` (all layers if ``None``) taken from ``exact``."""

    exact: KVBuffer
    rows: torch.Tensor
    upto_layer: int | None = None

    def apply(self, kv: KVBuffer) -> None:
        """Overwrite those rows of ``kv`` (a blend's assembled KV of the same prompt) in place."""
        if self.exact.length != kv.length or int(self.rows.numel()) != kv.length:
            raise ValueError(f"oracle of {self.exact.length} rows for a prompt of {kv.length}")
        layers = kv.keys.shape[0] if self.upto_layer is None else self.upto_layer + 1
        index = torch.nonzero(self.rows).reshape(-1).to(kv.keys.device)
        if index.numel() == 0 or layers <= 0:
            return
        for layer in range(min(layers, kv.keys.shape[0])):
            kv.keys[layer].index_copy_(1, index, self.exact.keys[layer][:, index].to(kv.keys))
            kv.values[layer].index_copy_(1, index, self.exact.values[layer][:, index].to(kv.values))
