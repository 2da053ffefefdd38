"""``kvshard bench recommender``: is the model a recommender, or a position bias? Base vs fine-tuned.

Why it exists. Fidelity to full prefill only means something if full prefill's answer depends on the
items. This benchmark asks each model, by full prefill in the blend engine (what the sidecar
serves), to rank the candidates of held-out users' *last* interactions — the target plus sampled
negatives the user never saw (:func:`kvshard.prompts.sample_requests`), from users the fine-tuning
never saw (:class:`kvshard.splits.UserSplit`) — and reports, per model:

* ``hr1``, ``hr5``, ``ndcg10`` — ranking by the candidates' label logits at the answer position
  (:mod:`kvshard.ranking`) — or, for a model merged from a ``--scorer isolated`` adapter, by each
  candidate's isolated score (:mod:`kvshard_sidecar.engine.isolated_scorer`; the row's ``scorer``) —,
  averaged over users and candidate permutations, with a 95 % bootstrap interval over users for HR@1,
  beside the random expectation;
* ``position_consistency`` — share of users whose chosen candidate is the same item under every one
  of ``--permutations`` random orders of the candidates (1/K^(orders-1) for a random chooser);
* ``max_label_share`` — share of all answers that went to the most chosen label letter (a
  position-biased model answers "A" everywhere: 1.0; the target's letter is uniform: ≈ 1/K).

Beside the models, two model-free rankings of the same requests say how good a recommender is at all:
popularity (rating count) and item-kNN (co-occurrence with the history over training users, the
fine-tuning teacher); their numbers are in every JSON row as ``popularity_*`` and ``item_knn_*``.

``--candidate-set retrieval`` replaces the uniform negatives with a retrieval stage's output
(:mod:`kvshard.retrieval`: item-kNN of the history over the training users, topped up with popular
items, ``--candidates`` of them), as a production system hands candidates to an LLM reranker. The
target is among them only when the stage retrieved it (never inserted), so the rows add the stage's
``retrieval_recall`` and its own order as a baseline (``retrieval_order_*``); ``hr1``/``ndcg10`` are over
all requests (a missed target scores 0 for every ranking) and ``retrieved_*`` over the requests whose
target was retrieved. The bar: the model's NDCG@10 above the retrieval order's.

Beside each model, ``<model> + retrieval score`` (``fused_with_retrieval``; ``--no-fuse-retrieval`` drops
it) ranks by the same scores fused with the retrieval stage's score of each candidate
(:func:`kvshard.ranking.fuse_scores`, :meth:`kvshard.retrieval.RetrievalIndex.scores`), on either
candidate set: what the sidecar answers a request that carries ``retrieval_scores`` (``--retrieval-weight``:
the stage's weight, as a request's ``retrieval_weight``; default each model's own, as the sidecar serves it).

``--positions N`` asks each sampled user's last N items instead of the last one (more requests from the
same held-out users; every interval then resamples users, a user's requests together), and under the table
the bench prints each ranking's paired difference from the first model listed and from each baseline on
the same requests (``paired`` in the JSON rows), the comparison to read when two rows' intervals overlap.

Every request is scored under the same permutations for every model. Rows carry the model name and
weights hash, the sample (dataset, users, history, candidates, seed, split) and whether the issue's
targets (HR@1 ≥ 0.30, consistency ≥ 0.8, no letter above 25 %) are met.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvshard.datasets import Dataset, load_dataset
from kvshard.prompts import (
    PromptBuilder,
    RecommendationPrompt,
    RecommendationRequest,
    candidate_orders,
    request_users,
    sample_requests,
)
from kvshard.ranking import QUALITY_METRICS, best_index, fuse_scores, quality, random_quality
from kvshard.retrieval import RetrievalIndex, RetrievedRequest, quality_or_miss, recall, retrieval_requests
from kvshard.splits import DEFAULT_HELDOUT_FRACTION, DEFAULT_SALT, UserSplit
from kvshard_bench.paired import PAIRED_METRICS, bootstrap_ci, paired_fields
from kvshard_bench.tables import format_cells
from kvshard_training.teacher import ItemKnnTeacher

Row = dict[str, Any]
TARGETS = {"hr1": 0.30, "position_consistency": 0.8, "max_label_share": 0.25}
BASELINE_NAMES = {"popularity": "popularity (rating count)", "item_knn": "item-kNN (training users)",
                  "retrieval_order": "retrieval order (the stage's own)"}
CANDIDATE_SETS = ("uniform", "retrieval")
FUSED_SUFFIX = "retrieval score"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvshard bench recommender``."""
    parser.add_argument("--dataset", default="movielens-100k", metavar="NAME|PATH",
                        help="built-in dataset name or folder (default: %(default)s)")
    parser.add_argument("--models", nargs="+", default=["base", "finetuned", "scorer", "late"],
                        metavar="base|finetuned|scorer|late|PATH",
                        help="models to compare: 'base' (prepared SmolLM2), 'finetuned' (the merged answer-position "
                             "recommender), 'scorer' (the merged isolated scorer), 'late' (the merged late-interaction "
                             "scorer) or a model folder; a merged model "
                             "that is not prepared is skipped (default: %(default)s)")
    parser.add_argument("--users", type=int, default=50, help="held-out users, one request each (default: %(default)s)")
    parser.add_argument("--history", type=int, default=30, help="history items per user (default: %(default)s)")
    parser.add_argument("--candidates", type=int, default=20,
                        help="candidates: the last item and sampled unseen negatives, or the items the retrieval "
                             "stage returns (default: %(default)s)")
    parser.add_argument("--candidate-set", choices=CANDIDATE_SETS, default="uniform",
                        help="'uniform': the target plus negatives drawn uniformly from unseen items; 'retrieval': "
                             "the retrieval stage's items (item-kNN of the history over training users, topped up "
                             "with popular items), the target only where retrieved (default: %(default)s)")
    parser.add_argument("--fuse-retrieval", action=argparse.BooleanOptionalAction, default=True,
                        help="beside each model, a '<model> + retrieval score' row: its scores fused with the "
                             "retrieval stage's score of each candidate (kvshard.retrieval: summed co-occurrence "
                             "with the history), z-scores summed 1 : 1, as the sidecar ranks a request that "
                             "carries retrieval_scores (default: on)")
    parser.add_argument("--retrieval-weight", type=float, default=None, metavar="W",
                        help="the stage's weight in those rows, z(model) + W · z(stage): a request's "
                             "retrieval_weight (default: each model's own, as the sidecar serves it: the weight "
                             "chosen on validation when it was trained, `kvshard model fusion-weight`; 1 where "
                             "none is recorded)")
    parser.add_argument("--positions", type=int, default=1,
                        help="targets per user: each user's last N interactions, latest first, each with the "
                             "--history items before it, so --users held-out users give up to N times the "
                             "requests; intervals resample users, a user's requests together (default: "
                             "%(default)s, the last item only)")
    parser.add_argument("--permutations", type=int, default=3,
                        help="candidate orders per request, for position consistency (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="sampling and permutation seed (default: %(default)s)")
    parser.add_argument("--all-users", action="store_true",
                        help="sample from every user, not only the held-out ones (training users' last items are "
                             "never trained on either, but their earlier items were)")
    parser.add_argument("--heldout-fraction", type=float, default=DEFAULT_HELDOUT_FRACTION,
                        help="the user split of `kvshard model finetune` (default: %(default)s)")
    parser.add_argument("--split-salt", default=DEFAULT_SALT, help="the user split's salt (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the rows as JSON")


def resolve_model(spec: str) -> Path | None:
    """'base' / 'finetuned' / 'scorer' / 'late' / a folder → a folder; ``None`` for a merged model that is not
    prepared."""
    from kvshard.models import resolve_model as resolve

    try:
        return resolve(spec)
    except FileNotFoundError:
        return None


def permutations(requests: Sequence[RecommendationRequest], count: int, seed: int) -> list[list[RecommendationRequest]]:
    """Per request: itself, then ``count - 1`` seeded reorderings of its candidates."""
    rng = random.Random(f"{seed}-permutations")
    return [candidate_orders(request, count, rng) for request in requests]


def summarize(choices: Sequence[Sequence[tuple[str, str]]], metrics: Sequence[Sequence[dict[str, float]]],
              seed: int, clusters: Sequence[str] | None = None) -> Row:
    """Quality and position statistics of one model.

    ``choices[r][p]`` is (chosen candidate id, its label) of request ``r`` under permutation ``p``;
    ``metrics[r][p]`` that answer's HR@1/HR@5/NDCG@10; ``clusters[r]`` the request's user, for the interval
    (``None``: one request per user).
    """
    per_request = per_request_quality(metrics)
    row: Row = {m: statistics.fmean(u[m] for u in per_request) if per_request else 0.0 for m in QUALITY_METRICS}
    row["hr1_ci"] = list(bootstrap_ci([u["hr1"] for u in per_request], seed, clusters=clusters))
    row["position_consistency"] = (statistics.fmean(float(len({c for c, _ in user}) == 1) for user in choices)
                                   if choices else 0.0)
    labels = Counter(label for user in choices for _, label in user)
    total = sum(labels.values())
    label, count = labels.most_common(1)[0] if labels else ("", 0)
    row["max_label_share"] = count / total if total else 0.0
    row["max_label"] = label
    return row


def per_request_quality(metrics: Sequence[Sequence[dict[str, float]]]) -> list[dict[str, float]]:
    """Each request's HR@1/HR@5/NDCG@10, averaged over its candidate orders."""
    return [{m: statistics.fmean(q[m] for q in orders) for m in QUALITY_METRICS} for orders in metrics]


def popularity_quality(dataset: Dataset, orders: Sequence[Sequence[RecommendationRequest]]) -> dict[str, float]:
    """HR@1/HR@5/NDCG@10 of ranking the candidates by rating count on the same requests and orders — the
    baseline to beat: against negatives drawn uniformly from unseen items, popularity alone ranks well
    (``bench/experiments/demo_trace_difficulty.py``). Counted over every interaction but the requests'
    targets, so no answer is leaked."""
    return baseline_quality(orders, popularity_scores(dataset, orders))


def popularity_scores(dataset: Dataset, orders: Sequence[Sequence[RecommendationRequest]]
                      ) -> Callable[[RecommendationRequest], list[float]]:
    """The popularity ranking of :func:`popularity_quality`: rating counts less the requests' targets."""
    counts = Counter(item for history in dataset.histories.values() for item in history)
    counts.subtract(Counter(str(user_orders[0].target) for user_orders in orders
                            if user_orders and user_orders[0].target is not None))
    return lambda r: [float(counts[c]) for c in r.candidates]


def item_knn_quality(dataset: Dataset, split: UserSplit,
                     orders: Sequence[Sequence[RecommendationRequest]]) -> dict[str, float]:
    """The same for item-kNN (:class:`~kvshard_training.teacher.ItemKnnTeacher`, the fine-tuning
    teacher): cosine co-occurrence over the *training* users' interactions before their second-to-last,
    summed over the request's history. The collaborative-filtering baseline a language-model recommender
    trained on these users is measured against — no held-out user and no target is in its counts."""
    return baseline_quality(orders, item_knn_scores(dataset, split))


def item_knn_scores(dataset: Dataset, split: UserSplit) -> Callable[[RecommendationRequest], list[float]]:
    """The item-kNN ranking of :func:`item_knn_quality`."""
    teacher = ItemKnnTeacher(dataset.histories, split.training_users(dataset))
    return lambda r: teacher.scores(r.history, r.candidates)


def baseline_quality(orders: Sequence[Sequence[RecommendationRequest]],
                     scores: Callable[[RecommendationRequest], list[float]]) -> dict[str, float]:
    """HR@1/HR@5/NDCG@10 of a model-free ranking ``scores`` on the benchmark's requests, averaged like a
    model's row (per request over the orders, then over requests); a target that is not among the
    candidates (the retrieval stage missed it) scores 0."""
    per_request = baseline_per_request(orders, scores)
    return {m: statistics.fmean(u[m] for u in per_request) if per_request else 0.0 for m in QUALITY_METRICS}


def baseline_per_request(orders: Sequence[Sequence[RecommendationRequest]],
                         scores: Callable[[RecommendationRequest], list[float]]) -> list[dict[str, float]]:
    """:func:`baseline_quality` per request (a request without a target scores 0), for paired comparisons."""
    per_request = []
    for request_orders in orders:
        answers = [quality(scores(r), r.candidates.index(str(r.target))) if r.target in r.candidates
                   else quality_or_miss(None) for r in request_orders if r.target is not None]
        per_request.append({m: statistics.fmean(a[m] for a in answers) if answers else 0.0 for m in QUALITY_METRICS})
    return per_request


def meets_targets(row: Row) -> bool:
    return bool(row["hr1"] >= TARGETS["hr1"] and row["position_consistency"] >= TARGETS["position_consistency"]
                and row["max_label_share"] <= TARGETS["max_label_share"])


class Answers:
    """Each request's answers under each candidate order, per name (one model here; readouts or variants of
    one model in the experiments that compare them on this bench's sample): the chosen candidate and its
    label, and the answer's HR@1/HR@5/NDCG@10 — what :func:`summarize` reads. (One request per user unless
    the bench runs with ``--positions``; the method names keep "user".)"""

    def __init__(self, names: Sequence[str]) -> None:
        self.choices: dict[str, list[list[tuple[str, str]]]] = {name: [] for name in names}
        self.metrics: dict[str, list[list[dict[str, float]]]] = {name: [] for name in names}

    def next_user(self) -> None:
        for name in self.choices:
            self.choices[name].append([])
            self.metrics[name].append([])

    def add(self, name: str, built: RecommendationPrompt, scores: Sequence[float]) -> None:
        """``scores`` of ``built``'s candidates, in its order, as the current request's next answer."""
        chosen = best_index(scores)
        self.choices[name][-1].append((built.request.candidates[chosen], built.labels[chosen]))
        target = built.target_index
        self.metrics[name][-1].append(quality(scores, target) if target is not None
                                      else dict.fromkeys(QUALITY_METRICS, 0.0))

    def subset_quality(self, name: str, keep: Sequence[bool]) -> dict[str, float]:
        """HR@1/HR@5/NDCG@10 of ``name`` averaged like :func:`summarize` over the requests ``keep`` selects
        (zeros when it selects none)."""
        if len(keep) != len(self.metrics[name]):
            raise ValueError(f"{len(keep)} flags for {len(self.metrics[name])} requests")
        chosen = per_request_quality([orders for orders, kept in zip(self.metrics[name], keep, strict=True) if kept])
        return {m: statistics.fmean(u[m] for u in chosen) if chosen else 0.0 for m in QUALITY_METRICS}

    def per_request(self, name: str) -> list[dict[str, float]]:
        """``name``'s HR@1/HR@5/NDCG@10 per request (over its orders), for paired comparisons."""
        return per_request_quality(self.metrics[name])

    def rows(self, seed: int, prefix: str = "", clusters: Sequence[str] | None = None) -> list[Row]:
        """One :func:`summarize` row per name (``model``: ``prefix`` + name), with ``targets_met``."""
        rows: list[Row] = []
        for name in self.choices:
            row = summarize(self.choices[name], self.metrics[name], seed, clusters)
            row["model"] = f"{prefix}{name}"
            row["targets_met"] = meets_targets(row)
            rows.append(row)
        return rows


def sample_line(users: int, candidates: int, history: int, orders: int, who: str = "held-out users",
                requests: int | None = None) -> str:
    items = "last items" if requests is None or requests == users else f"last items ({requests} requests)"
    return f"{users} {who}' {items}, {candidates} candidates, history {history}, {orders} candidate orders each"


def evaluate_model(path: Path, dataset: Dataset, orders: Sequence[Sequence[RecommendationRequest]],
                   seed: int, progress: bool = True, retrieved: Sequence[bool] | None = None,
                   stage_scores: Callable[[RecommendationRequest], list[float]] | None = None,
                   retrieval_weight: float | None = None, clusters: Sequence[str] | None = None
                   ) -> tuple[list[Row], dict[str, list[dict[str, float]]]]:
    """Score every permutation of every request with the blend engine's full prefill — the label logits at
    the answer position, or for a model trained as an isolated scorer its per-candidate scores
    (:mod:`kvshard_sidecar.engine.isolated_scorer`, float32 head); one summary row, and with
    ``stage_scores`` a second (``<model> + retrieval score``) ranking by the same scores fused with the
    retrieval stage's (:func:`kvshard.ranking.fuse_scores`, weight ``retrieval_weight``, by default the model's
    recorded one: what the sidecar answers a request that carries ``retrieval_scores``). ``retrieved`` flags
    the requests whose target the retrieval stage retrieved: the rows add ``retrieved_*`` over those; ``clusters`` names
    each request's user (intervals resample users). Also returns each row's per-request quality, by model
    name, for paired comparisons."""
    from kvshard.models import model_retrieval_weight, model_scorer, model_template
    from kvshard_sidecar.engine import BlendEngine, MemoryBlockSource
    from kvshard_sidecar.engine.isolated_scorer import Readout, scoring_prompt
    from kvshard_sidecar.engine.model import load_model

    loaded = load_model(path)
    scorer = model_scorer(path)
    weight = model_retrieval_weight(path) if retrieval_weight is None else retrieval_weight
    readout = Readout.for_model(loaded.tokenizer, path)
    engine = BlendEngine(loaded.model, loaded.identity, MemoryBlockSource())

    def scores(built: RecommendationPrompt) -> list[float]:
        if readout is None:
            return [float(s) for s in engine.full(built.prompt).logits[list(built.label_token_ids)].tolist()]
        scored = engine.full(scoring_prompt(built), readout=readout).scores
        assert scored is not None
        return [float(s) for s in scored.tolist()]

    # each model is asked as it was trained (a merged adapter records its template's label position)
    builder = PromptBuilder(loaded.tokenizer, dataset, template=model_template(path))
    name = loaded.identity.name
    fused_name = f"{name} + {'' if weight == 1.0 else f'{weight:g} × '}{FUSED_SUFFIX}"
    answers = Answers([name, fused_name] if stage_scores is not None else [name])
    tokens: list[int] = []
    bar = tqdm(total=sum(len(o) for o in orders), desc=f"recommender {loaded.identity.name}", unit="prompt",
               disable=not progress)
    for user_orders in orders:
        answers.next_user()
        for request in user_orders:
            built = builder.build(request)
            with torch.inference_mode():
                model_scores = scores(built)
            answers.add(name, built, model_scores)
            if stage_scores is not None:
                answers.add(fused_name, built, fuse_scores(model_scores, stage_scores(request), weight))
            tokens.append(len(built.prompt))
            bar.update()
    bar.close()
    rows = []
    for summary in answers.rows(seed, clusters=clusters):
        row: Row = {"model": summary["model"], "revision": loaded.identity.revision, "path": str(path),
                    "label_position": builder.template.label_position, "scorer": scorer,
                    "fused_with_retrieval": summary["model"] == fused_name,
                    "retrieval_weight": weight if summary["model"] == fused_name else None}
        row.update({k: v for k, v in summary.items() if k not in ("model", "targets_met")})
        if retrieved is not None:
            row.update({f"retrieved_{m}": v for m, v in answers.subset_quality(summary["model"], retrieved).items()})
        row["tokens"] = round(statistics.fmean(tokens)) if tokens else 0
        rows.append(row)
    return rows, {name: answers.per_request(name) for name in answers.metrics}


def run(args: argparse.Namespace) -> list[Row]:
    """Evaluate every model on the same requests and permutations; print a table, write JSON if asked."""
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = load_dataset(args.dataset)
    split = UserSplit(args.heldout_fraction, args.split_salt)
    pool = dataset if args.all_users else split.heldout_dataset(dataset)
    stage: list[RetrievedRequest] | None = None
    index = RetrievalIndex.fit(dataset, split)  # the stage's candidates and scores (fused beside each model)
    if args.candidate_set == "retrieval":
        if args.all_users:
            raise SystemExit("--candidate-set retrieval samples held-out users only: the retrieval stage's "
                             "statistics are the training users' (drop --all-users)")
        if args.candidates < 2:
            raise SystemExit("--candidates must be at least 2")
        stage = retrieval_requests(pool, index, args.users, args.history,
                                   args.candidates, args.seed, args.positions)
        requests = [r.request for r in stage]
    else:
        requests = sample_requests(pool, args.users, args.history, args.candidates, args.seed, args.positions)
    if not requests:
        raise SystemExit(f"no {'' if args.all_users else 'held-out '}user of {args.dataset} has more than "
                         f"{args.history} interactions")
    orders = permutations(requests, max(1, args.permutations), args.seed)
    users = request_users(requests)
    clusters = users if args.positions > 1 else None
    sample = {"dataset": dataset.name, "users": len(set(users)), "requests": len(requests), "history": args.history,
              "candidates": args.candidates, "permutations": max(1, args.permutations), "seed": args.seed,
              "split": "all users" if args.all_users else
              f"held-out users (fraction {args.heldout_fraction}, salt {args.split_salt})",
              "target": ("each user's last interaction" if args.positions == 1 else
                         f"each user's last {args.positions} interactions (intervals resample users)"),
              "positions": args.positions, "candidate_set": args.candidate_set}
    expected: dict[str, float | int] = {f"random_{m}": v for m, v in random_quality(args.candidates).items()}
    baseline_requests = {"popularity": baseline_per_request(orders, popularity_scores(dataset, orders)),
                         "item_knn": baseline_per_request(orders, item_knn_scores(dataset, split))}
    retrieved = [r.retrieved for r in stage] if stage is not None else None
    if stage is not None:  # recall, the stage's own order and a random reranking, all and retrieved-only
        expected = retrieval_fields(stage, args.candidates)
        baseline_requests["retrieval_order"] = [quality_or_miss(r.retrieval_rank) for r in stage]
    baselines = {name: {m: statistics.fmean(q[m] for q in values) for m in QUALITY_METRICS}
                 for name, values in baseline_requests.items()}
    expected |= {f"{name}_{m}": v for name, quality_of in baselines.items() for m, v in quality_of.items()}
    stage_scores = (lambda r: index.scores(r.history, r.candidates)) if args.fuse_retrieval else None
    rows: list[Row] = []
    reference: tuple[str, list[dict[str, float]]] | None = None
    for spec in args.models:
        path = resolve_model(spec)
        if path is None:
            print(f"skipping {spec!r}: it is not prepared (`kvshard model prepare` merges the shipped "
                  "adapters; `kvshard model merge ADAPTER` merges your own)")
            continue
        model_rows, per_request = evaluate_model(path, dataset, orders, args.seed, retrieved=retrieved,
                                                 stage_scores=stage_scores, retrieval_weight=args.retrieval_weight,
                                                 clusters=clusters)
        for row in model_rows:
            ranking = per_request[row["model"]]
            references = dict(baseline_requests)
            if reference is not None:
                references = {reference[0]: reference[1], **references}
            row.update(expected, **sample, targets_met=meets_targets(row),
                       paired=paired_fields(ranking, references, args.seed, clusters))
            reference = reference or (row["model"], ranking)
            rows.append(row)
    line = sample_line(sample["users"], args.candidates, args.history, sample["permutations"], "users", len(requests))
    print(f"{line}, seed {args.seed}, {sample['split']}")
    print(format_table(rows, args.candidates, sample["permutations"], baselines))
    if stage is not None:
        print(format_retrieval_table(rows, expected))
    print(format_paired(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


def format_paired(rows: Sequence[Row]) -> str:
    """Each ranking minus each reference on the same requests, with the paired 95 % interval: the table to
    read when two rows' own intervals overlap."""
    headers = ["ranking", "minus", *(f"{m} difference (95% CI)" for m in PAIRED_METRICS)]
    cells = [[row["model"], BASELINE_NAMES.get(name, name),
              *(f"{d[0]:+.3f} ({d[1]:+.3f} … {d[2]:+.3f})" for d in (pairs[m] for m in PAIRED_METRICS))]
             for row in rows for name, pairs in row["paired"].items()]
    return "paired differences (same requests; intervals resample users)\n" + format_cells(headers, cells)


def retrieval_fields(stage: Sequence[RetrievedRequest], candidates: int) -> dict[str, float | int]:
    """The retrieval stage's fields of every row: its recall@K (``retrieval_recall``, and how many targets
    it retrieved), its own order's HR@1/HR@5/NDCG@10 over all requests (a miss scores 0) and over the
    retrieved ones, and a random reranking's expectation of both (``random_*``: recall × the random
    expectation for ``candidates``; ``random_retrieved_*``: that expectation)."""
    hits = recall(stage)
    fields: dict[str, float | int] = {"retrieval_recall": hits, "retrieval_retrieved": sum(r.retrieved for r in stage)}
    chance = random_quality(candidates)
    found = [quality_or_miss(r.retrieval_rank) for r in stage if r.retrieved]
    for m in QUALITY_METRICS:
        fields[f"retrieval_order_{m}"] = (statistics.fmean(quality_or_miss(r.retrieval_rank)[m] for r in stage)
                                          if stage else 0.0)
        fields[f"retrieval_order_retrieved_{m}"] = statistics.fmean(q[m] for q in found) if found else 0.0
        fields[f"random_{m}"] = hits * chance[m]
        fields[f"random_retrieved_{m}"] = chance[m]
    return fields


def format_retrieval_table(rows: Sequence[Row], stage: Mapping[str, float | int]) -> str:
    """Each model beside the retrieval order and a random reranking, over all requests (a missed target
    scores 0) and over the requests whose target was retrieved — with the stage's recall in the title."""
    headers = ["ranking", "ndcg10 (all)", "hr1 (all)", "ndcg10 (retrieved)", "hr1 (retrieved)"]
    cells = [[row["model"], f"{row['ndcg10']:.3f}", f"{row['hr1']:.3f}", f"{row['retrieved_ndcg10']:.3f}",
              f"{row['retrieved_hr1']:.3f}"] for row in rows]
    for name, prefix in ((BASELINE_NAMES["retrieval_order"], "retrieval_order_"), ("random", "random_")):
        cells.append([name, f"{stage[prefix + 'ndcg10']:.3f}", f"{stage[prefix + 'hr1']:.3f}",
                      f"{stage[prefix + 'retrieved_ndcg10']:.3f}", f"{stage[prefix + 'retrieved_hr1']:.3f}"])
    title = (f"retrieval-stage candidates: recall@K {stage['retrieval_recall']:.3f} "
             f"({stage['retrieval_retrieved']} targets retrieved); a missed target scores 0 in 'all'")
    return title + "\n" + format_cells(headers, cells)


def format_table(rows: Sequence[Row], candidates: int, orders: int,
                 baselines: dict[str, dict[str, float]] | None = None) -> str:
    headers = ["model", "hr1", "hr1 95% CI", "hr5", "ndcg10", "consistency", "max label", "targets"]
    cells = [[row["model"], f"{row['hr1']:.3f}", f"{row['hr1_ci'][0]:.2f}–{row['hr1_ci'][1]:.2f}",
              f"{row['hr5']:.3f}", f"{row['ndcg10']:.3f}", f"{row['position_consistency']:.2f}",
              f"{row['max_label_share']:.2f} ({row['max_label']})", "met" if row["targets_met"] else "not met"]
             for row in rows]
    for name, baseline in (baselines or {}).items():
        cells.append([BASELINE_NAMES[name], f"{baseline['hr1']:.3f}", "-", f"{baseline['hr5']:.3f}",
                      f"{baseline['ndcg10']:.3f}", "1.00", "-", "-"])
    expected = random_quality(candidates)
    if rows and rows[0].get("candidate_set") == "retrieval":  # a random reranking of what was retrieved
        expected = {m: float(rows[0][f"random_{m}"]) for m in QUALITY_METRICS}
    cells.append(["random", f"{expected['hr1']:.3f}", "-", f"{expected['hr5']:.3f}", f"{expected['ndcg10']:.3f}",
                  f"{1 / candidates ** (orders - 1):.4f}", f"~{1 / candidates:.2f}", "-"])
    return format_cells(headers, cells)
