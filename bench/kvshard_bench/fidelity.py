"""``kvshard bench fidelity``: TTFT and fidelity to full prefill of every blend method, side by side.

The answer a recommender returns is the ranking over the candidates' labels (:mod:`kvshard.ranking`),
so fidelity to ``full`` is measured on it. Per request and method:

* ``top1_agreement`` — the method's chosen *candidate* (argmax over the label logits) is full's;
* ``token_top1_agreement`` — the free first token equals full's (a near tie between "A" and "The"
  flips it while the ranking barely moves: kept for comparison, not to gate on);
* ``tau`` — Kendall tau-b between full's and the method's candidate-label logits;
* ``label_kl`` — KL(full ‖ method) over the candidate labels only (softmax over their logits);
* ``kl`` — the same over the whole vocabulary.

Recommendation quality sits beside fidelity so a reader sees both "same as full prefill" and "useful at
all": ``hr1``, ``hr5`` and ``ndcg10`` of each method's ranking against the user's held-out item (the
``full`` row is full prefill's own quality), and a ``random`` row with a uniformly random ranking's
expectation.

TTFT is the median over requests with every block already cached (each prompt is blended once,
cold, before the timed runs); the cold path (blocks computed, then stored) is a separate row.
``ideal_speedup`` is full's token-layers over the method's (DESIGN §4's cost model). Methods run
interleaved per request so a noisy neighbour slows all of them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvshard.datasets import load_dataset
from kvshard.prompts import PromptBuilder, RecommendationPrompt, sample_requests
from kvshard.ranking import QUALITY_METRICS, best_index, kendall_tau, quality, random_quality
from kvshard_sidecar.adapter_merge import MODEL_HELP, resolve_model
from kvshard_sidecar.engine import BlendEngine, BlendResult, BlendSettings, MemoryBlockSource

Row = dict[str, Any]
DEFAULT_RATIOS = (0.05, 0.1, 0.15, 0.3)
PREFIX_RATIO = -1.0  # samples key for ``prefix``; its row reports the measured recompute ratio


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvshard bench fidelity``."""
    parser.add_argument("--dataset", default="movielens-100k", metavar="NAME|PATH",
                        help="built-in dataset name or folder (default: %(default)s)")
    parser.add_argument("--users", type=int, default=8, help="requests, one per user (default: %(default)s)")
    parser.add_argument("--history", type=int, default=30, help="history items per user (default: %(default)s)")
    parser.add_argument("--candidates", type=int, default=20, help="candidates per request (default: %(default)s)")
    parser.add_argument("--ratios", type=float, nargs="+", default=list(DEFAULT_RATIOS),
                        help="recompute ratios for boundary/deviation/hybrid (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="request sampling seed (default: %(default)s)")
    parser.add_argument("--model", default=None, metavar="base|finetuned|PATH",
                        help=f"{MODEL_HELP} (default: base)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per request and method (default: 1)")
    parser.add_argument("--prefill-context", choices=["standalone", "system", "neutral"], default="system",
                        help="how segment blocks are prefilled (default: %(default)s)")
    parser.add_argument("--neutral-text", default="\nCandidates:\nA. ",
                        help="text behind the system segment that 'neutral' prefill puts before later segments "
                             "(default: %(default)r)")
    parser.add_argument("--deviation-on", choices=["k", "v", "kv"], default="kv",
                        help="deviation measured on K, V or both (default: %(default)s)")
    parser.add_argument("--deviation-weight", choices=["none", "attention"], default="none",
                        help="weight deviation by the suffix's attention at the check layer (default: %(default)s)")
    parser.add_argument("--check-layers", type=int, nargs="+", default=[1],
                        help="check layers of deviation/hybrid (default: %(default)s)")
    parser.add_argument("--first-ratio", type=float, default=0.3,
                        help="gradual filtering: ratio kept at the first check layer, narrowing linearly to "
                             "r at the last; 0 disables (r at every check layer) (default: %(default)s)")
    parser.add_argument("--boundary-w", type=int, default=1,
                        help="segment-start tokens hybrid always recomputes (default: %(default)s)")
    parser.add_argument("--recompute-free", action="store_true",
                        help="always recompute FREE segments (labels, headers)")
    parser.add_argument("--memory", action="store_true",
                        help="also measure peak memory of full, prefix and deviation at r=0.15 (child process)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write a kl-vs-TTFT PNG")


def schedule(first: float, ratio: float, layers: int) -> tuple[float, ...]:
    """Gradual filtering: from ``max(first, ratio)`` at the first check layer linearly down to ``ratio``."""
    if layers <= 1 or first <= 0:
        return ()
    start = max(first, ratio)
    return tuple(start + (ratio - start) * i / (layers - 1) for i in range(layers))


def method_settings(
    args: argparse.Namespace, neutral: tuple[int, ...] = ()
) -> list[tuple[str, float, BlendSettings]]:
    """Every (method, ratio, settings) the benchmark runs besides ``full`` and ``prefix``."""
    base = BlendSettings(
        neutral_context=neutral if args.prefill_context == "neutral" else (),
        prefill_context=args.prefill_context, deviation_on=args.deviation_on,
        deviation_weight=args.deviation_weight,
        check_layers=tuple(args.check_layers), recompute_free=args.recompute_free,
    )
    methods: list[tuple[str, float, BlendSettings]] = [("none", 0.0, base.with_(selector="none", ratio=0.0))]
    for selector in ("boundary", "deviation", "hybrid"):
        for ratio in args.ratios:
            steps = schedule(args.first_ratio, ratio, len(args.check_layers))
            settings = base.with_(selector=selector, ratio=ratio, schedule=steps,
                                  boundary_w=args.boundary_w if selector == "hybrid" else None)
            methods.append((selector, ratio, settings))
    return methods


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    """KL(reference ‖ other) in nats, from logits."""
    p, q = reference.double().log_softmax(-1), other.double().log_softmax(-1)
    return max(0.0, float((p.exp() * (p - q)).sum()))


def score(full: BlendResult, result: BlendResult, request: RecommendationPrompt) -> dict[str, float]:
    """Fidelity of ``result`` to ``full`` and its recommendation quality, for one request."""
    labels = torch.tensor(request.label_token_ids)
    ref_labels, label_logits = full.logits[labels].tolist(), result.logits[labels].tolist()
    target = request.target_index
    return {
        "kl": kl_divergence(full.logits, result.logits),
        "label_kl": kl_divergence(torch.tensor(ref_labels), torch.tensor(label_logits)),
        "tau": kendall_tau(ref_labels, label_logits),
        "top1_agreement": float(best_index(ref_labels) == best_index(label_logits)),
        "token_top1_agreement": float(int(full.logits.argmax()) == int(result.logits.argmax())),
        **(quality(label_logits, target) if target is not None else {}),
    }


def run(args: argparse.Namespace) -> list[Row]:
    """Run every method on every request; print a table, write JSON/PNG if asked; return the rows."""
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = load_dataset(args.dataset)
    model = resolve_model(args.model)
    engine = BlendEngine.load(model, MemoryBlockSource())
    tokenizer = engine_tokenizer(model)
    builder = PromptBuilder(tokenizer, dataset)
    sampled = sample_requests(dataset, args.users, args.history, args.candidates, args.seed)
    requests = [builder.build(r) for r in sampled]
    if not requests:
        raise SystemExit(f"no user of {args.dataset} has more than {args.history} interactions")
    methods = method_settings(args, tuple(tokenizer.encode(args.neutral_text, add_special_tokens=False)))
    samples: dict[tuple[str, float], list[dict[str, float]]] = {}
    cold_ms: list[float] = []
    engine.full(requests[0].prompt)  # warm up allocator and kernels; not timed
    progress = tqdm(total=len(requests) * (len(methods) + 3), desc="fidelity", unit="run")
    for request in requests:
        prompt = request.prompt
        cold = engine.blend(prompt, methods[-1][2])  # cold path: this request's uncached blocks computed
        cold_ms.append(cold.ttft_s * 1e3)
        progress.update()
        full = _timed(args.repeats, engine.full, prompt)
        progress.update()
        runs: list[tuple[str, float, BlendResult]] = [("full", 1.0, full)]
        runs.append(("prefix", PREFIX_RATIO, _timed(args.repeats, engine.prefix, prompt)))
        progress.update()
        for name, ratio, settings in methods:
            runs.append((name, ratio, _timed(args.repeats, engine.blend, prompt, settings)))
            progress.update()
        for name, ratio, result in runs:
            row = score(full, result, request)
            row.update(ttft_ms=result.ttft_s * 1e3, ideal=result.ideal_speedup, tokens=result.num_tokens,
                       recompute=result.recompute_ratio)
            samples.setdefault((name, ratio), []).append(row)
    progress.close()
    rows = summarize(samples, cold_ms, args.candidates)
    print(f"{len(requests)} requests, {args.history} history items, {args.candidates} candidates, "
          f"~{statistics.mean(r['tokens'] for r in samples[('full', 1.0)]):.0f} tokens; "
          f"prefill context {args.prefill_context}, deviation on {args.deviation_on} "
          f"(weight {args.deviation_weight}), "
          f"check layers {args.check_layers}, first ratio {args.first_ratio}, "
          f"recompute free {args.recompute_free}, torch threads {torch.get_num_threads()}")
    print(format_table(rows))
    if args.memory:
        report_memory(args, methods, rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot:
        plot(rows, args.plot)
    return rows


def report_memory(args: argparse.Namespace, methods: Sequence[tuple[str, float, BlendSettings]],
                  rows: list[Row]) -> None:
    """Peak RSS added by one prefill per method (see :mod:`kvshard_bench.blend_memory`); rows gain fields."""
    from dataclasses import asdict

    from kvshard_bench.blend_memory import measure

    chosen = next((s for name, ratio, s in methods if name == "deviation" and abs(ratio - 0.15) < 1e-9),
                  methods[-1][2])
    config = {"dataset": args.dataset, "history": args.history, "candidates": args.candidates, "seed": args.seed,
              "model": str(resolve_model(args.model)), "threads": args.threads,
              "settings": asdict(chosen)}
    measured = {m["method"]: m for m in measure(config)}
    for row in rows:
        found = measured.get(row["method"])
        if found and (row["method"] != chosen.selector or row["ratio"] == round(chosen.ratio, 4)):
            row["peak_delta_mb"], row["kv_mb"] = found["peak_delta_mb"], found["kv_mb"]
    full, blended = measured["full"], measured[chosen.selector]
    verdict = "met" if blended["peak_delta_mb"] <= full["peak_delta_mb"] + blended["kv_mb"] else "NOT met"
    print(f"peak memory added by one prefill ({full['tokens']} tokens): full {full['peak_delta_mb']} MB, "
          f"prefix {measured['prefix']['peak_delta_mb']} MB, {chosen.selector} r={chosen.ratio} "
          f"{blended['peak_delta_mb']} MB; blended KV {blended['kv_mb']} MB -> "
          f"target blended <= full + KV {verdict}"
          + ("" if full["peak_reset"] else " (peak counter could not be reset: upper bounds)"))


def engine_tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _timed(repeats: int, call: Callable[..., BlendResult], *call_args: Any) -> BlendResult:
    """The run with the median TTFT among ``repeats`` runs of ``call(*call_args)``."""
    results = [call(*call_args) for _ in range(max(1, repeats))]
    results.sort(key=lambda r: r.ttft_s)
    return results[len(results) // 2]


FIDELITY_METRICS = ("kl", "label_kl", "tau", "top1_agreement", "token_top1_agreement")


def summarize(samples: dict[tuple[str, float], list[dict[str, float]]], cold_ms: list[float],
              candidates: int) -> list[Row]:
    full_ms = statistics.median(s["ttft_ms"] for s in samples[("full", 1.0)])
    prefix_ms = statistics.median(s["ttft_ms"] for (name, _), runs in samples.items() if name == "prefix"
                                  for s in runs)
    rows: list[Row] = []
    for (name, ratio), runs in samples.items():
        ttft = statistics.median(s["ttft_ms"] for s in runs)
        if name == "prefix":
            ratio = statistics.mean(s["recompute"] for s in runs)
        row: Row = {"method": name, "ratio": round(ratio, 4), "ttft_ms": round(ttft, 2),
                    "speedup_vs_full": round(full_ms / ttft, 3), "speedup_vs_prefix": round(prefix_ms / ttft, 3),
                    "ideal_speedup": round(statistics.mean(s["ideal"] for s in runs), 3)}
        for metric in (*FIDELITY_METRICS, *QUALITY_METRICS):
            values = [s[metric] for s in runs if metric in s]
            row[metric] = round(statistics.mean(values), 4) if values else None
        row["recompute_ratio"] = round(statistics.mean(s["recompute"] for s in runs), 4)
        rows.append(row)
    empty = dict.fromkeys(("ideal_speedup", *FIDELITY_METRICS, *QUALITY_METRICS, "recompute_ratio"))
    cold = statistics.median(cold_ms)
    rows.append({**empty, "method": "cold", "ratio": None, "ttft_ms": round(cold, 2),
                 "speedup_vs_full": round(full_ms / cold, 3), "speedup_vs_prefix": round(prefix_ms / cold, 3),
                 "note": "first blend of each request, its uncached blocks computed and stored"})
    expected = {metric: round(value, 4) for metric, value in random_quality(candidates).items()}
    rows.append({**empty, **expected, "method": "random", "ratio": None, "ttft_ms": None, "speedup_vs_full": None,
                 "speedup_vs_prefix": None,
                 "note": f"expected quality of a uniformly random ranking of {candidates} candidates"})
    return rows


def format_table(rows: Sequence[Row]) -> str:
    columns = ["method", "ratio", "ttft_ms", "speedup_vs_full", "speedup_vs_prefix", "ideal_speedup",
               "top1_agreement", "token_top1_agreement", "tau", "label_kl", "kl", "hr1", "hr5", "ndcg10",
               "recompute_ratio"]
    headers = ["method", "r", "ttft_ms", "x_full", "x_prefix", "ideal", "cand_top1", "token_top1", "tau",
               "label_kl", "kl", "hr1", "hr5", "ndcg10", "recomp"]
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def plot(rows: Sequence[Row], path: Path) -> None:
    """Fidelity (kl, nats; full and prefix sit at 0) against median TTFT, one series per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    by_method: dict[str, list[Row]] = {}
    for row in rows:
        if row["kl"] is not None:
            by_method.setdefault(row["method"], []).append(row)
    for method, points in by_method.items():
        points.sort(key=lambda r: r["ttft_ms"])
        xs = [p["ttft_ms"] for p in points]
        ys = [p["kl"] for p in points]
        axes.plot(xs, ys, marker="o", label=method)
        if len(points) > 1:
            for p, x, y in zip(points, xs, ys, strict=True):
                axes.annotate(f"r={p['ratio']}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes.set_xscale("log")
    axes.set_ylim(bottom=-0.02)
    axes.set_xlabel("median TTFT (ms, blocks cached; log scale)")
    axes.set_ylabel("KL(full ‖ method), nats")
    axes.set_title("kvshard blend: fidelity vs TTFT")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


