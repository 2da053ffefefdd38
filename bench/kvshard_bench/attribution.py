"""``kvshard bench fidelity --attribution``: which stale rows carry the blend's error, and from which layer.

Each row of the table is a blend that recomputes only the question (selector ``none``) after some of
its stale rows were replaced by full prefill's exact rows (:class:`~kvshard_sidecar.engine.oracle.Oracle`):

* **by kind** — system, history, the ``Candidates:`` header, the labels (and each label token: the
  letter, ``"."``, ``" "``), the items, the instruction, and the unions that matter;
* **by depth** — every blended row exact for layers ``<= ℓ`` only, stale above.

A kind whose exact rows bring KL to ~0 carries the error; one whose exact rows make it *worse* shows
an inconsistency between kinds (FINDINGS.md: exact labels beside stale items). Rows already exact
(the exact prefix) or always recomputed (the instruction) change nothing: they are listed so the
table covers every kind.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm import tqdm

from kvshard.prompts import RecommendationPrompt
from kvshard_bench.tables import format_cells
from kvshard_sidecar.engine import BlendEngine, BlendResult, BlendSettings
from kvshard_sidecar.engine.oracle import Oracle, part_rows

Row = dict[str, Any]
KIND_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("none (all stale)", ()),
    ("system", ("system",)),
    ("history", ("history",)),
    ("header", ("header",)),
    ("labels", ("labels",)),
    ("label letters", ("label_letter",)),
    ("label '.'", ("label_dot",)),
    ("label ' '", ("label_space",)),
    ("items", ("items",)),
    ("instruction", ("instruction",)),
    ("labels+header", ("labels", "header")),
    ("items+header", ("items", "header")),
    ("items+labels", ("items", "labels")),
    ("items+labels+header", ("items", "labels", "header")),
    ("everything", ("system", "history", "header", "labels", "items", "instruction")),
)
PRINTED_LAYERS = (0, 1, 2, 4, 8, 12, 16, 20, 24, 26, 28)


def oracles(request: RecommendationPrompt, full_kv: Any, num_layers: int) -> list[tuple[str, str, Oracle]]:
    """Every (group, name, oracle) of the attribution for one request: kinds, then layers."""
    prompt = request.prompt
    found = [("kind", name, Oracle(full_kv, part_rows(prompt, parts))) for name, parts in KIND_ROWS]
    everything = torch.ones(len(prompt), dtype=torch.bool)
    found += [("layer", f"layers <= {layer}", Oracle(full_kv, everything, layer)) for layer in range(num_layers)]
    return found


Scorer = Callable[[BlendResult, BlendResult, RecommendationPrompt], dict[str, float]]


def run_attribution(engine: BlendEngine, requests: Sequence[RecommendationPrompt], settings: BlendSettings,
                    score: Scorer) -> list[Row]:
    """Mean fidelity per oracle over ``requests``; ``settings`` fixes the prefill context (selector none)."""
    settings = settings.with_(selector="none", ratio=0.0, schedule=())
    layers = engine.executor.shape.num_layers
    samples: dict[tuple[str, str], list[dict[str, float]]] = {}
    progress = tqdm(total=len(requests) * (len(KIND_ROWS) + layers), desc="attribution", unit="run")
    for request in requests:
        full = engine.full(request.prompt)
        n = len(request.prompt)
        for group, name, oracle in oracles(request, full.kv, layers):
            result = engine.blend(request.prompt, settings, oracle=oracle)
            scored = score(full, result, request)
            scored["oracle_share"] = float(oracle.rows[result.exact_prefix_tokens:n].float().mean())
            samples.setdefault((group, name), []).append(scored)
            progress.update()
    progress.close()
    rows: list[Row] = []
    for (group, name), runs in samples.items():
        row: Row = {"group": group, "oracle": name, "prefill_context": settings.prefill_context, "users": len(runs)}
        for metric in ("kl", "label_kl", "tau", "top1_agreement", "token_top1_agreement", "oracle_share"):
            row[metric] = round(statistics.mean(r[metric] for r in runs), 4)
        rows.append(row)
    return rows


def format_attribution(rows: Sequence[Row]) -> str:
    """One table: the kinds, then the printed layers (every layer is in the JSON rows)."""
    shown = [r for r in rows if r["group"] == "kind" or int(r["oracle"].split()[-1]) in PRINTED_LAYERS]
    headers = ["exact rows (oracle)", "share", "kl", "label_kl", "tau", "cand_top1", "token_top1"]
    cells = [[r["oracle"], f"{r['oracle_share']:.2f}", f"{r['kl']:.4f}", f"{r['label_kl']:.4f}", f"{r['tau']:.2f}",
              f"{r['top1_agreement']:.2f}", f"{r['token_top1_agreement']:.2f}"] for r in shown]
    return format_cells(headers, cells)
