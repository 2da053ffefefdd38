"""Isolating experiment (issue 12): recompute share vs which rows are fresh vs attention sinks.

Same 12 users (MovieLens-100k, H=30, K=20, seed 0), one engine; BlendSettings set directly.
For each prefill context (standalone, system) runs: none, epic k=1, epic k=2 (first tokens of every block:
sinks + labels), epic with k = the k EPIC picks at r=0.5 on standalone blocks, and tail matched per user to
that epic row's recomputed token count (same share, different rows). Plus tail r=0.85 on system (the known row).

Run: ``.venv/bin/python bench/experiments/recompute_share.py 12`` (about 10 minutes on 2 cores). Its answer is
in README's blending section: the baselines' near-exact r = 0.5 rows recompute the whole candidate list, which on
system-context blocks is exactly what a prefix cache computes.
"""
from __future__ import annotations

import json
import statistics
import sys

import torch

from kvshard.datasets import load_dataset
from kvshard.models import model_template, resolve_model
from kvshard.prompts import PromptBuilder, sample_requests
from kvshard_bench.fidelity import engine_tokenizer, score
from kvshard_bench.tables import format_rows
from kvshard_sidecar.engine import BlendEngine, BlendSettings, MemoryBlockSource
from kvshard_sidecar.engine.selectors import epic_k_for, keep_count

torch.set_num_threads(1)
USERS = int(sys.argv[1]) if len(sys.argv) > 1 else 12
dataset = load_dataset("movielens-100k")
model = resolve_model(None)
engine = BlendEngine.load(model, MemoryBlockSource())
builder = PromptBuilder(engine_tokenizer(model), dataset, template=model_template(model))
requests = [builder.build(r) for r in sample_requests(dataset, USERS, 30, 20, 0)]

rows: dict[str, list[dict[str, float]]] = {}


def add(name: str, full, result, request) -> None:
    row = score(full, result, request)
    row.update(recompute=result.recompute_ratio, ideal=result.ideal_speedup)
    rows.setdefault(name, []).append(row)


for request in requests:
    prompt = request.prompt
    full = engine.full(prompt)
    suffix = len(prompt.segments[-1])
    epic_std = engine.blend(prompt, BlendSettings(selector="epic", ratio=0.5, prefill_context="standalone"))
    std = BlendSettings(selector="epic", ratio=0.5, prefill_context="standalone")
    layout = engine.layout(prompt, epic_std.exact_prefix_tokens, std)
    k = epic_k_for(layout, keep_count(0.5, layout.num_candidates))
    rows.setdefault("_k", []).append({"k": k})
    for context in ("standalone", "system"):
        base = BlendSettings(prefill_context=context)  # type: ignore[arg-type]
        add(f"{context} none", full, engine.blend(prompt, base.with_(selector="none", ratio=0.0)), request)
        for kk in (1, 2):
            add(f"{context} epic k={kk}", full, engine.blend(prompt, base.with_(selector="epic", ratio=0.5, epic_k=kk)),
                request)
        epic = engine.blend(prompt, base.with_(selector="epic", ratio=0.5, epic_k=k))
        add(f"{context} epic k=K(r.5 std)", full, epic, request)
        m = engine.layout(prompt, epic.exact_prefix_tokens, base).num_candidates
        ratio = min(1.0, max(0.0, (epic.recomputed_tokens - suffix) / m))
        tail = engine.blend(prompt, base.with_(selector="tail", ratio=ratio))
        add(f"{context} tail matched to epic k=K", full, tail, request)
    add("system tail r=0.85", full, engine.blend(prompt, BlendSettings(prefill_context="system", selector="tail",
                                                                      ratio=0.85)), request)
    add("system epic r=0.85 (auto k)", full, engine.blend(prompt, BlendSettings(prefill_context="system",
                                                                               selector="epic", ratio=0.85)), request)
    add("system boundary r=0.85", full, engine.blend(prompt, BlendSettings(prefill_context="system",
                                                                          selector="boundary", ratio=0.85)), request)
    print("user done", request.request.user_id, "k", k, flush=True)

ks = [r["k"] for r in rows.pop("_k")]
table = []
for name, runs in rows.items():
    table.append({"run": name, **{m: round(statistics.mean(r[m] for r in runs), 4)
                                  for m in ("recompute", "ideal", "kl", "label_kl", "tau", "top1_agreement")}})
print(f"{USERS} users; EPIC's k at r=0.5 on standalone blocks per user: {ks}")
print(format_rows(["run", "recomp", "ideal_x", "kl", "label_kl", "tau", "cand_top1"],
                  ["run", "recompute", "ideal", "kl", "label_kl", "tau", "top1_agreement"], table))
json.dump(table, open("/tmp/kvs12/isolate.json", "w"), indent=1)
