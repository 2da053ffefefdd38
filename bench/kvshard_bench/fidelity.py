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
``ideal_speedup`` is full's token-layers over the method's (the cost model of
docs/blending-and-fidelity.md#how-a-blend-works). Methods run
interleaved per request so a noisy neighbour slows all of them alike.

Methods are named (:mod:`kvshard_sidecar.engine.methods`): the selectors, the baselines ``cacheblend``
and ``epic``, and corrections after ``+`` (``deviation+structure``, ``tail+ape`` …). Two more modes:
``--attribution`` (:mod:`kvshard_bench.attribution`: which stale rows carry the error) and ``--sweep``
(:mod:`kvshard_bench.frontier`: every method at every ratio, and the frontier PNG).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvshard.datasets import load_dataset
from kvshard.models import MEASURED_MODEL, MODEL_HELP, model_scorer, model_template, resolve_model
from kvshard.prompts import PromptBuilder, PromptTemplate, RecommendationPrompt, sample_requests
from kvshard.ranking import QUALITY_METRICS, best_index, kendall_tau, quality, random_quality
from kvshard_bench.attribution import format_attribution, run_attribution
from kvshard_bench.frontier import SWEEP_METHODS, SWEEP_RATIOS, format_sweep, plot_frontier, sweep_specs
from kvshard_bench.tables import format_rows
from kvshard_sidecar.engine import BlendEngine, BlendResult, BlendSettings, MemoryBlockSource
from kvshard_sidecar.engine.contexts import averaging_contexts
from kvshard_sidecar.engine.isolated_scorer import Readout, prefill_context_for, scoring_prompt
from kvshard_sidecar.engine.methods import method_settings as named_settings
from kvshard_sidecar.engine.settings import PREFILL_CONTEXTS

Row = dict[str, Any]
DEFAULT_RATIOS = (0.05, 0.1, 0.15, 0.3)
DEFAULT_METHODS = ("none", "tail", "boundary", "deviation", "hybrid", "cacheblend", "epic")
PREFIX_RATIO = -1.0  # samples key for ``prefix``; its row reports the measured recompute ratio


def ratio_value(text: str) -> float:
    """A recompute ratio in [0, 1] (argparse type)."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a ratio must be in [0, 1], got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvshard bench fidelity``."""
    parser.add_argument("--dataset", default="movielens-100k", metavar="NAME|PATH",
                        help="built-in dataset name or folder (default: %(default)s)")
    parser.add_argument("--users", type=int, default=8, help="requests, one per user (default: %(default)s)")
    parser.add_argument("--history", type=int, nargs="+", default=[30],
                        help="history items per user; several values repeat the run per size (default: %(default)s)")
    parser.add_argument("--candidates", type=int, nargs="+", default=[20],
                        help="candidates per request; several values repeat the run per size (default: %(default)s)")
    parser.add_argument("--ratios", type=ratio_value, nargs="+", default=None,
                        help=f"recompute ratios in [0, 1] (default: {list(DEFAULT_RATIOS)}; "
                             f"with --sweep {list(SWEEP_RATIOS)})")
    parser.add_argument("--methods", nargs="+", default=None, metavar="METHOD[+CORRECTION]",
                        help=f"methods to run (default: {' '.join(DEFAULT_METHODS)}; with --sweep every method "
                             "and correction); corrections: +tail +structure +labels +segment +ape")
    parser.add_argument("--attribution", action="store_true",
                        help="error attribution: replace stale rows of each kind (and every layer <= l) by full "
                             "prefill's exact rows and report KL / tau / top-1")
    parser.add_argument("--sweep", action="store_true",
                        help="the frontier: every method at every ratio, table + two-panel PNG (--plot, default "
                             "fidelity-frontier.png)")
    parser.add_argument("--recalibrate", action="store_true",
                        help="recompute the model's attention calibration (+ape methods) even if one is stored")
    parser.add_argument("--seed", type=int, default=0, help="request sampling seed (default: %(default)s)")
    parser.add_argument("--model", default=None, metavar="late|finetuned|scorer|base|PATH",
                        help=f"{MODEL_HELP} (default: {MEASURED_MODEL}; --attribution, --memory and +ape measure an "
                             "answer-position model: 'finetuned' or 'base')")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per request and method (default: 1)")
    parser.add_argument("--prefill-context", choices=list(PREFILL_CONTEXTS), default=None,
                        help="how segment blocks are prefilled; 'averaged': item blocks averaged over "
                             "--appearances seeded in-list contexts (default: the sidecar's for the model: "
                             "'history' for a late-interaction scorer, whose items read only themselves, "
                             "else 'system')")
    parser.add_argument("--appearances", type=int, default=3,
                        help="in-list appearances an 'averaged' item block is averaged over (default: %(default)s)")
    parser.add_argument("--neutral-text", default=None,
                        help="text behind the system segment that 'neutral' prefill puts before later segments "
                             "(default: what precedes a first item: the list header and, with labels before "
                             "items, the first label, '\\nCandidates:\\nA. ')")
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


def base_settings(args: argparse.Namespace, neutral: tuple[int, ...] = (),
                  averaged: tuple[tuple[int, ...], ...] = ()) -> BlendSettings:
    """The settings every method starts from (prefill context, deviation options) before its own."""
    return BlendSettings(
        neutral_context=neutral if args.prefill_context == "neutral" else (),
        averaged_contexts=averaged if args.prefill_context == "averaged" else (),
        prefill_context=args.prefill_context or "system", deviation_on=args.deviation_on,
        deviation_weight=args.deviation_weight,
        check_layers=tuple(args.check_layers), recompute_free=args.recompute_free,
    )


def method_settings(
    args: argparse.Namespace, neutral: tuple[int, ...] = (), calibration: tuple[float, float] | None = None,
    averaged: tuple[tuple[int, ...], ...] = (),
) -> list[tuple[str, float, BlendSettings]]:
    """Every (method, ratio, settings) the benchmark runs besides ``full`` and ``prefix``."""
    base = base_settings(args, neutral, averaged)
    sweeping = getattr(args, "sweep", False)
    methods = getattr(args, "methods", None) or (SWEEP_METHODS if sweeping else DEFAULT_METHODS)
    ratios = args.ratios if args.ratios is not None else (SWEEP_RATIOS if sweeping else DEFAULT_RATIOS)
    found: list[tuple[str, float, BlendSettings]] = []
    for spec, ratio in sweep_specs(methods, ratios):
        selector = spec.split("+")[0]
        tuned = base
        if selector in ("deviation", "hybrid"):
            tuned = base.with_(schedule=schedule(args.first_ratio, ratio, len(args.check_layers)),
                               boundary_w=args.boundary_w if selector == "hybrid" else None)
        if selector in ("none", "boundary", "tail", "cacheblend", "epic"):
            tuned = base.with_(schedule=(), boundary_w=None)
        found.append((spec, ratio, named_settings(spec, ratio, tuned, calibration)))
    return found


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    """KL(reference ‖ other) in nats, from logits."""
    p, q = reference.double().log_softmax(-1), other.double().log_softmax(-1)
    return max(0.0, float((p.exp() * (p - q)).sum()))


def candidate_scores(result: BlendResult, request: RecommendationPrompt) -> list[float]:
    """What ranks the candidates: the isolated scorer's scores, or the label logits at the answer position."""
    if result.scores is not None:
        return [float(s) for s in result.scores.tolist()]
    return [float(s) for s in result.logits[list(request.label_token_ids)].tolist()]


def score(full: BlendResult, result: BlendResult, request: RecommendationPrompt) -> dict[str, float]:
    """Fidelity of ``result`` to ``full`` and its recommendation quality, for one request.

    For the isolated scorer there is no first-token distribution: ``kl`` is then the label KL (over the
    softmax of the K candidates' scores) and ``token_top1_agreement`` the candidate agreement."""
    ref_labels, label_logits = candidate_scores(full, request), candidate_scores(result, request)
    target = request.target_index
    label_kl = kl_divergence(torch.tensor(ref_labels), torch.tensor(label_logits))
    top1 = float(best_index(ref_labels) == best_index(label_logits))
    scorer = result.scores is not None
    return {
        "kl": label_kl if scorer else kl_divergence(full.logits, result.logits),
        "label_kl": label_kl,
        "tau": kendall_tau(ref_labels, label_logits),
        "top1_agreement": top1,
        "token_top1_agreement": top1 if scorer else float(int(full.logits.argmax()) == int(result.logits.argmax())),
        **(quality(label_logits, target) if target is not None else {}),
    }


def run(args: argparse.Namespace) -> list[Row]:
    """Run the chosen mode for every prompt size; print tables, write JSON/PNG if asked; return the rows."""
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = load_dataset(args.dataset)
    model = resolve_model(args.model, MEASURED_MODEL)
    tokenizer = engine_tokenizer(model)
    scorer = model_scorer(model)
    readout = Readout.for_model(tokenizer, model)
    if args.prefill_context is None:
        args.prefill_context = prefill_context_for(scorer)
    if readout is not None and args.sweep and not args.methods:
        args.methods = [m for m in SWEEP_METHODS if "+ape" not in m]
        print(f"{model.name} ranks with the {scorer} scorer: the sweep leaves out +ape (a calibration of the answer "
              "position's attention)")
    if readout is not None and (args.attribution or args.memory or _calibrated(args)):
        raise SystemExit(f"{model.name} ranks with the {scorer} scorer: --attribution, --memory and +ape (in --sweep "
                         "too) measure the answer position's prefill and are not built for it; add --model finetuned "
                         "(or base), or choose --methods without +ape")
    engine = BlendEngine.load(model, MemoryBlockSource())
    builder = PromptBuilder(tokenizer, dataset, template=model_template(model))
    neutral = tuple(tokenizer.encode(neutral_text(builder.template, args.neutral_text), add_special_tokens=False))
    averaged = in_list_contexts(builder, tokenizer, args.appearances, args.seed) \
        if args.prefill_context == "averaged" else ()
    rows: list[Row] = []
    for history in args.history:
        for candidates in args.candidates:
            sampled = sample_requests(dataset, args.users, history, candidates, args.seed)
            requests = [builder.build(r) for r in sampled]
            if not requests:
                raise SystemExit(f"no user of {args.dataset} has more than {history} interactions")
            size = {"history": history, "candidates": candidates}
            if args.attribution:
                found = run_attribution(engine, requests, base_settings(args, neutral, averaged), score)
                print(f"attribution: {len(requests)} requests, {history} history items, {candidates} candidates, "
                      f"prefill context {args.prefill_context}; blend recomputes only the question")
                print(format_attribution(found))
                rows += [{**size, **row} for row in found]
                continue
            calibration = _calibration(args, engine, model, builder, dataset, history, candidates,
                                       base_settings(args, neutral, averaged), [r.user_id for r in sampled])
            methods = method_settings(args, neutral, calibration, averaged)
            found = measure(args, engine, requests, methods, readout)
            rows += [{**size, **row} for row in found]
    if not args.attribution:
        several_sizes = len(args.history) * len(args.candidates) > 1  # one table: rows must say their size
        print(format_sweep(rows) if args.sweep or several_sizes else format_table(rows))
    if args.memory and not args.attribution:
        report_memory(args, [m for m in method_settings(args, neutral, (1.0, 1.0), averaged)
                             if "+ape" not in m[0]], rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.sweep:
        path = args.plot or Path("fidelity-frontier.png")
        plot_frontier(rows, path)
        print(f"frontier plot: {path}")
    elif args.plot and not args.attribution:
        plot(rows, args.plot)
    return rows


def neutral_text(template: PromptTemplate, given: str | None) -> str:
    """``--neutral-text`` or what precedes a prompt's first item under ``template``."""
    if given is not None:
        return given
    return template.candidates_header + ("" if template.label_after else template.label_text("A"))


def in_list_contexts(builder: PromptBuilder, tokenizer: Any, appearances: int, seed: int
                     ) -> tuple[tuple[int, ...], ...]:
    """Seeded in-list contexts for ``averaged`` item blocks from the catalog: the prompt's own list
    header and labels, other catalog items as the neighbours (tokenized as the prompt tokenizes them)."""
    labels = [segment.token_ids for segment in builder.label_segments]
    items = sorted(builder.dataset.items)
    fillers = [builder.item_segment(item).token_ids for item in items]
    return averaging_contexts(builder.candidates_segment.token_ids, labels, fillers, appearances, seed,
                              label_after=builder.template.label_after)


def _calibrated(args: argparse.Namespace) -> bool:
    """Whether a method to run asks for the attention calibration (``+ape``)."""
    return any("+ape" in m for m in args.methods or (SWEEP_METHODS if args.sweep else DEFAULT_METHODS))


def _calibration(args: argparse.Namespace, engine: BlendEngine, model: Path, builder: PromptBuilder, dataset: Any,
                 history: int, candidates: int, base: BlendSettings, users: list[str]
                 ) -> tuple[float, float] | None:
    """The model's attention calibration when a method asks for it (``+ape``), else ``None``."""
    if not _calibrated(args):
        return None
    from kvshard_bench.calibrate import load_or_calibrate, overlap

    calibration = load_or_calibrate(engine, model, builder, dataset, history, candidates, base, args.recalibrate)
    shared = overlap(calibration, users)
    if shared:
        raise SystemExit(f"the calibration was fitted on benchmark users {shared}: recalibrate or change --seed")
    print(f"attention calibration: temperature {calibration.temperature}, scale {calibration.scale} "
          f"(fitted on users {calibration.provenance.get('users')}, seed {calibration.provenance.get('seed')})")
    return calibration.temperature, calibration.scale


def measure(args: argparse.Namespace, engine: BlendEngine, requests: Sequence[RecommendationPrompt],
            methods: Sequence[tuple[str, float, BlendSettings]], readout: Readout | None = None) -> list[Row]:
    """Every method on every request (interleaved per request); the summarized rows. With ``readout``
    the model is an isolated scorer: every path scores the candidates of the :func:`scoring_prompt`."""
    samples: dict[tuple[str, float], list[dict[str, float]]] = {}
    cold_ms: list[float] = []
    engine.full(requests[0].prompt)  # warm up allocator and kernels; not timed
    progress = tqdm(total=len(requests) * (len(methods) + 3), desc="fidelity", unit="run")
    for request in requests:
        prompt = request.prompt if readout is None else scoring_prompt(request)
        for context in sorted({s.prefill_context for _, _, s in methods}):  # store every block kind once, untimed
            cold = engine.blend(prompt, next(s for _, _, s in methods if s.prefill_context == context),
                                readout=readout)
            if context == args.prefill_context:
                cold_ms.append(cold.ttft_s * 1e3)
        progress.update()
        full = _timed(args.repeats, partial(engine.full, prompt, readout=readout))
        progress.update()
        runs: list[tuple[str, float, BlendResult]] = [("full", 1.0, full)]
        runs.append(("prefix", PREFIX_RATIO, _timed(args.repeats, partial(engine.prefix, prompt, readout=readout))))
        progress.update()
        for name, ratio, settings in methods:
            runs.append((name, ratio, _timed(args.repeats, partial(engine.blend, prompt, settings, readout=readout))))
            progress.update()
        for name, ratio, result in runs:
            row = score(full, result, request)
            row.update(ttft_ms=result.ttft_s * 1e3, ideal=result.ideal_speedup, tokens=result.num_tokens,
                       recompute=result.recompute_ratio)
            samples.setdefault((name, ratio), []).append(row)
    progress.close()
    candidates = len(requests[0].labels)
    rows = summarize(samples, cold_ms or [float("nan")], candidates)
    print(f"{len(requests)} requests, {len(requests[0].request.history)} history items, {candidates} candidates, "
          f"~{statistics.mean(r['tokens'] for r in samples[('full', 1.0)]):.0f} tokens; "
          f"prefill context {args.prefill_context}, deviation on {args.deviation_on} "
          f"(weight {args.deviation_weight}), "
          f"check layers {args.check_layers}, first ratio {args.first_ratio}, "
          f"recompute free {args.recompute_free}, torch threads {torch.get_num_threads()}")
    return rows


def report_memory(args: argparse.Namespace, methods: Sequence[tuple[str, float, BlendSettings]],
                  rows: list[Row]) -> None:
    """Peak RSS added by one prefill per method (see :mod:`kvshard_bench.blend_memory`); rows gain fields."""
    from dataclasses import asdict

    from kvshard_bench.blend_memory import measure

    chosen = next((s for name, ratio, s in methods if name == "deviation" and abs(ratio - 0.15) < 1e-9),
                  methods[-1][2])
    config = {"dataset": args.dataset, "history": args.history[0], "candidates": args.candidates[0], "seed": args.seed,
              "model": str(resolve_model(args.model, MEASURED_MODEL)), "threads": args.threads,
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


def _timed(repeats: int, call: Callable[[], BlendResult]) -> BlendResult:
    """The run with the median TTFT among ``repeats`` runs of ``call()``."""
    results = [call() for _ in range(max(1, repeats))]
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
    return format_rows(headers, columns, rows)


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


