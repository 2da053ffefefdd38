"""Isolating experiment (issue 42's open surprise): why CacheBlend's standalone prefill loses more of the
shipped late scorer's ranking than of the one it replaced (top-1 .79 against .92 on 24 users).

Under ``--prefill-context standalone`` a late scorer's only stale rows are the history's: every item body
reads only its item (exact alone), and the readers (each item's last ``interaction`` tokens and label
opening) and the question are always recomputed. The history block, though, is prefilled alone at
position 0, without the system prompt before it; the readers then attend to those rows. So the whole loss
is in how the readers take stale history rows, and this script measures, per model, on the same requests:

* **oracles** — the blend (selector ``none``, standalone blocks) after some stale history rows are replaced
  by full prefill's exact rows (:class:`~kvshard_sidecar.engine.oracle.Oracle`): none; the history's first
  row only (a block prefilled at position 0 makes its first token an attention sink; mid-prompt that row is
  a false sink); every history row but the first; the whole history; and the whole history exact for
  layers ``<= l`` only;
* **the stale rows themselves** — per layer, the relative deviation ``|stale − exact| / |exact|`` of the
  history's keys and values, first row and the rest apart: whether one adapter's history KV moves more
  without its system prompt, or its readers take the same deviation harder.

Each oracle's top-1 agreement with full prefill and its label KL (over the softmax of the candidates'
scores) is the mean over the requests; ``paired`` is the difference between the two models on the same
requests with its 95 % interval (users resampled).

Run: ``cd bench/experiments && ../../.venv/bin/python standalone_history.py [USERS] [MODEL ...]`` (default 96
users; models ``late`` and the adapter it replaced, merged at ``~/.cache/kvshard/exp/late-replaced`` by
``git show 52fb9f0:training/kvshard_training/adapters/movielens-late/<file>`` and ``kvshard model merge``).
About 8 s per request and model on two cores (27 minutes for 96 users and two models). ``attention [USERS]
[MODEL ...]`` (default 24 users) prints instead the attention the readers pay to the history's first row
and to its other rows, per layer, under full prefill and under the standalone blend.

Answer (2026-12-07, 96 users; the first 24 are ``kvshard bench fidelity --users 24``'s):

    exact rows (oracle)                  shipped late     replaced        paired shipped − replaced
    none (history stale)                 .885 / .0157     .865 / .0200    +.021 (−.073 … +.125)
    the history's first row exact        .865 / .0144     .896 / .0179    −.031 (−.125 … +.062)
    the history but its first row exact  1.000 / .0005    .948 / .0010    +.052 (+.010 … +.104)
    the history exact in layers <= 16    .896 / .0173     .896 / .0155    +.000 (−.073 … +.083)
    the history exact in layers <= 18    .990 / .0016     .990 / .0020    +.000 (−.031 … +.031)

(top-1 agreement with full prefill / label KL). The .79 against .92 of 24 users is sampling: the same
bench on those 24 gives .792 and .917 again, the other 72 users .917 and .847, and on all 96 the two are
level. Both adapters lose the same way: the stale rows deviate alike (relative to the exact rows, the
history's first row ~1.0 in every layer from 1 on, its other rows .09–.18 in the keys and .14–.41 in the
values, equal to two digits between the adapters), the false sink the first row becomes draws .10–.21 of
the readers' attention from layer 3 on (exact: under .012) yet carries little of the error, and the error
enters in layers 17–18: exact history rows up to layer 16 change nothing, up to 18 give .99.
"""

from __future__ import annotations

import statistics
import sys
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from kvshard.datasets import load_dataset
from kvshard.models import model_template, resolve_model
from kvshard.prompts import PromptBuilder, RecommendationPrompt, sample_requests
from kvshard.segments import Prompt
from kvshard_bench.fidelity import engine_tokenizer, score
from kvshard_bench.paired import paired_difference
from kvshard_sidecar.engine import BlendEngine, BlendSettings, MemoryBlockSource
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, Readout, scoring_prompt
from kvshard_sidecar.engine.oracle import Oracle, part_rows
from kvshard_sidecar.engine.selectors import attention_received

REPLACED = Path.home() / ".cache/kvshard/exp/late-replaced"
DEPTHS = (0, 4, 8, 12, 14, 15, 16, 18, 20, 24, 29)
STANDALONE = BlendSettings(prefill_context="standalone", selector="none", ratio=0.0)
"""Every block prefilled alone at position 0, only the readers and the question recomputed."""


def loaded(model_name: str, users: int) -> tuple[Path, BlendEngine, Readout, list[RecommendationPrompt]]:
    """A merged late scorer's engine and readout, and the fidelity bench's requests (history 10, 20 candidates,
    seed 0: ``kvshard bench fidelity --users N``'s first N)."""
    model = resolve_model(model_name, "late")
    tokenizer = engine_tokenizer(model)
    readout = Readout.for_model(tokenizer, model)
    assert readout is not None, f"{model} is not a scorer"
    dataset = load_dataset("movielens-100k")
    builder = PromptBuilder(tokenizer, dataset, template=model_template(model))
    requests = [builder.build(r) for r in sample_requests(dataset, users, 10, 20, 0)]
    return model, BlendEngine.load(model, MemoryBlockSource()), readout, requests


def history_rows(prompt: Prompt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bool masks over the prompt: the history, its first row, the history but its first row."""
    history = part_rows(prompt, ["history"])
    first = torch.zeros_like(history)
    first[int(torch.nonzero(history)[0])] = True
    return history, first, history & ~first


def measure(model_name: str, users: int) -> tuple[dict[str, list[dict[str, float]]], dict[str, torch.Tensor]]:
    """Per oracle, one score row per request; per (k|v, first|rest), the deviation per layer (mean)."""
    model, engine, readout, requests = loaded(model_name, users)
    layers = engine.executor.shape.num_layers
    rows: dict[str, list[dict[str, float]]] = {}
    deviation: dict[str, list[torch.Tensor]] = {}
    for request in tqdm(requests, desc=model.name, unit="request"):
        prompt = scoring_prompt(request)
        engine.blend(prompt, STANDALONE, readout=readout)  # stores the standalone blocks
        full = engine.full(prompt, readout=readout)
        history, first, rest = history_rows(prompt)
        oracles: dict[str, Oracle | None] = {
            "none (history stale)": None,
            "history's first row exact": Oracle(full.kv, first),
            "history but its first row exact": Oracle(full.kv, rest),
            "history exact": Oracle(full.kv, history),
            **{f"history exact in layers <= {d}": Oracle(full.kv, history, d) for d in DEPTHS if d < layers},
        }
        for name, oracle in oracles.items():
            result = engine.blend(prompt, STANDALONE, oracle=oracle, readout=readout)
            rows.setdefault(name, []).append(score(full, result, request))
            if oracle is None:
                for kind, stale, exact in (("k", result.kv.keys, full.kv.keys), ("v", result.kv.values,
                                                                                  full.kv.values)):
                    for part, mask in (("first", first), ("rest", rest)):
                        index = torch.nonzero(mask).reshape(-1)
                        a, b = stale[:, :, index].float(), exact[:, :, index].float()
                        per_layer = (a - b).flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1)
                        deviation.setdefault(f"{kind} {part}", []).append(per_layer)
    return rows, {key: torch.stack(v).mean(0) for key, v in deviation.items()}


def attention_paid(model_name: str, users: int) -> dict[str, torch.Tensor]:
    """Per layer, the attention probability the readers (rows that see the history and are neither system
    nor history: each item's interaction tokens, the labels, the question) pay to the history's first row
    and to the rest of the history, under full prefill (``exact``) and under the standalone blend
    (``stale``): mean over heads, readers and requests."""
    model, engine, readout, requests = loaded(model_name, users)
    executor = engine.executor
    finish = executor.finish
    probe: tuple[str, torch.Tensor] | None = None  # (path, reader queries) while a run is recorded
    parts: dict[str, torch.Tensor] = {}
    paid: dict[str, list[list[torch.Tensor]]] = {}

    def recording(layer: int, hidden: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
        if probe is not None and mask is not None:
            path, queries = probe
            received = attention_received(q[0][:, queries], keys[0], mask[queries], executor.scaling)
            for part, rows in parts.items():
                per_layer = paid.setdefault(f"{path} {part}", [[] for _ in range(executor.shape.num_layers)])
                per_layer[layer].append(received[rows].sum())
        return finish(layer, hidden, q, keys, values, mask, causal)

    executor.finish = recording  # type: ignore[method-assign]
    for request in tqdm(requests, desc=f"attention {model.name}", unit="request"):
        prompt = scoring_prompt(request)
        stale = engine.blend(prompt, STANDALONE, readout=readout)
        history, parts["first"], parts["rest"] = history_rows(prompt)
        allowed = IsolatedInputs.of_prompt(prompt, readout.interaction).mask_and_positions()[0][0, 0]
        readers = allowed[:, int(torch.nonzero(parts["first"])[0])] & ~history & ~part_rows(prompt, ["system"])
        runs = (("exact", torch.arange(len(prompt)), partial(engine.full, prompt, readout=readout)),
                ("stale", stale.selected, partial(engine.blend, prompt, STANDALONE, readout=readout)))
        for path, running, run in runs:  # the queries of a run are its running rows, in order
            probe = (path, torch.nonzero(readers[running]).reshape(-1))
            run()
        probe = None
    executor.finish = finish  # type: ignore[method-assign]
    return {key: torch.stack([torch.stack(v).mean() for v in per_layer]) for key, per_layer in paid.items()}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "attention":
        users = int(sys.argv[2]) if len(sys.argv) > 2 else 24
        for m in sys.argv[3:] or ["late", str(REPLACED)]:
            print(f"\n{Path(m).name}: attention the readers pay to the history, by layer (0, 3, …), {users} requests")
            for key, per_layer in attention_paid(m, users).items():
                print(f"  {key:<12} " + " ".join(f"{float(x):.3f}" for x in per_layer[::3]))
        return
    users = int(sys.argv[1]) if len(sys.argv) > 1 else 96
    models = sys.argv[2:] or ["late", str(REPLACED)]
    measured = {m: measure(m, users) for m in models}
    names = list(next(iter(measured.values()))[0])
    print(f"\n{users} requests (movielens-100k, history 10, 20 candidates, seed 0), standalone blocks, selector none")
    header = "".join(f"{Path(m).name[:22]:>24}" for m in models)
    print(f"{'exact rows (oracle)':<36}{header}   (top-1 agreement / label KL)")
    for name in names:
        cells = ""
        for m in models:
            runs = measured[m][0][name]
            top1, kl = (statistics.mean(r[k] for r in runs) for k in ("top1_agreement", "label_kl"))
            cells += f"{top1:>14.3f} / {kl:.4f}"
        print(f"{name:<36}{cells}")
    if len(models) == 2:
        a, b = (measured[m][0] for m in models)
        print(f"\npaired {Path(models[0]).name} − {Path(models[1]).name}, top-1 agreement (95 % CI):")
        for name in names:
            mean, low, high = paired_difference([r["top1_agreement"] for r in a[name]],
                                                [r["top1_agreement"] for r in b[name]], seed=0)
            print(f"  {name:<36}{mean:+.3f} ({low:+.3f} … {high:+.3f})")
    print("\nrelative deviation of the stale history rows, |stale − exact| / |exact|, by layer")
    for m in models:
        deviations = measured[m][1]
        print(f"  {Path(m).name}")
        for key, per_layer in deviations.items():
            shown = " ".join(f"{float(x):.2f}" for x in per_layer[::3])
            print(f"    {key:<8} layers 0,3,…: {shown}")


if __name__ == "__main__":
    main()
