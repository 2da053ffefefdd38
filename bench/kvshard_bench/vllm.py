"""``kvshard bench vllm``: TTFT through vLLM + KvshardConnector, side by side with the alternatives.

All modes serve the same MovieLens prompts, measured in one run:

* ``vllm_apc`` — plain vLLM with automatic prefix caching: each user's first request warms vLLM's
  cache, the second (same history, new candidates) is measured, so system + history are a prefix
  hit and vLLM prefills the candidates and question. The baseline a production stack has today.
* ``vllm_full`` — the same vLLM with the connector but no exchange entry: a full prefill.
* ``embedded`` — kvshard's blend engine decodes itself (blocks warm).
* ``vllm_connector`` — kvshard blends (blocks warm), writes the prompt KV to the exchange, vLLM
  loads it through the connector and computes only the last prompt token; TTFT = blend + exchange
  write + vLLM's first streamed token.

Requests are measured one at a time with ``--gap-seconds`` of idle time before each, in every mode:
on this 2-core machine vLLM's CPU worker keeps a core busy for about a second after it answers, and
a blend started in that second runs 4x slower — an artifact of sharing two cores, not of either
path. TTFT here is single-request latency at low load.

Two vLLM servers run one after the other (one with the connector and no prefix cache, so blended
KV never leaks into its cache; one plain with prefix caching), each started and stopped here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm import tqdm

from kvshard.datasets import Dataset, load_dataset
from kvshard.models import DEFAULT_MODEL, MODEL_HELP, model_template, resolve_model, scorer_refusal
from kvshard.processes import ManagedProcess
from kvshard.prompts import PromptBuilder, RecommendationRequest, sample_requests
from kvshard.segments import Prompt
from kvshard.testing_servers import free_port
from kvshard_sidecar.engine.blend import BlendEngine
from kvshard_sidecar.engine.settings import BlendSettings
from kvshard_sidecar.engine.source import MemoryBlockSource
from kvshard_sidecar.exchange import KVExchange
from kvshard_sidecar.model import load_model
from kvshard_sidecar.vllm_client import VllmClient, server_command

Row = dict[str, object]
SERVED_NAME = "kvshard-bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="movielens-100k", help="built-in name or folder (default: %(default)s)")
    parser.add_argument("--model", default=None, metavar="base|finetuned|PATH",
                        help=f"{MODEL_HELP} (default: {DEFAULT_MODEL})")
    parser.add_argument("--users", type=int, default=6, help="users, two requests each (default: %(default)s)")
    parser.add_argument("--history", type=int, default=30, help="history items (default: %(default)s)")
    parser.add_argument("--candidates", type=int, default=20, help="candidates (default: %(default)s)")
    parser.add_argument("--selector", default="deviation", choices=["none", "boundary", "deviation", "hybrid"])
    parser.add_argument("--ratio", type=float, default=0.15, help="recompute ratio (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gap-seconds", type=float, default=2.0,
                        help="idle time before each measured request (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the rows as JSON")


def other_candidates(request: RecommendationRequest, dataset: Dataset, seed: int) -> RecommendationRequest:
    """The same user and history with a fresh candidate set (the held-out item kept)."""
    rng = random.Random(seed)
    seen = set(dataset.histories[request.user_id])
    pool = [i for i in sorted(dataset.items) if i not in seen and i not in request.candidates]
    fresh = [request.target or request.candidates[0], *rng.sample(pool, len(request.candidates) - 1)]
    rng.shuffle(fresh)
    return RecommendationRequest(request.user_id, request.history, tuple(fresh), request.target)


def _vllm(model: Path, work: Path, name: str, exchange: Path | None, prefix_caching: bool) -> ManagedProcess:
    port = free_port()
    return ManagedProcess(
        server_command(sys.executable, model, port, exchange_dir=exchange, prefix_caching=prefix_caching,
                       served_name=SERVED_NAME),
        work / f"{name}.log", f"http://127.0.0.1:{port}/health",
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}, start_timeout=600)


def _url(process: ManagedProcess) -> str:
    return process.ready_url.rsplit("/", 1)[0]


def _median_ms(values: Sequence[float]) -> float:
    return round(statistics.median(values) * 1000, 2)


def run(args: argparse.Namespace) -> list[Row]:
    dataset = load_dataset(args.dataset)
    model = resolve_model(args.model)
    if refusal := scorer_refusal(model, "bench vllm"):
        raise SystemExit(refusal)
    loaded = load_model(model)
    builder = PromptBuilder(loaded.tokenizer, dataset, template=model_template(model))
    firsts = sample_requests(dataset, args.users, args.history, args.candidates, seed=args.seed)
    pairs = [(builder.build(r).prompt, builder.build(other_candidates(r, dataset, args.seed + i)).prompt)
             for i, r in enumerate(firsts)]
    settings = BlendSettings(selector=args.selector, ratio=args.ratio)
    engine = BlendEngine(loaded.model, loaded.identity, MemoryBlockSource(), settings)
    for first, second in tqdm(pairs, desc="warm blocks", unit="user"):
        engine.blend(first)
        engine.blend(second)
    measured = [second for _, second in pairs]
    print(f"{len(measured)} measured prompts, {statistics.mean(len(p) for p in measured):.0f} tokens on average")

    def settled(measure: Callable[[Prompt], float]) -> Callable[[Prompt], float]:
        def run_one(prompt: Prompt) -> float:
            time.sleep(args.gap_seconds)
            return measure(prompt)
        return run_one

    ttft: dict[str, list[float]] = {"embedded": [settled(lambda p: engine.blend(p).ttft_s)(p) for p in measured]}
    model_path = loaded.path
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None  # the exchange lives in shared memory in a pod
    with tempfile.TemporaryDirectory(prefix="kvshard-bench-vllm-") as scratch, \
            tempfile.TemporaryDirectory(prefix="kvshard-bench-exchange-", dir=shm) as exchange_scratch:
        work = Path(scratch)
        exchange_dir = Path(exchange_scratch)
        exchange = KVExchange(exchange_dir)
        with _vllm(model_path, work, "vllm-connector", exchange_dir, prefix_caching=False) as server:
            client = VllmClient(_url(server), SERVED_NAME)
            client.complete(measured[0].token_ids, 1)  # first request pays vLLM's lazy warm-up
            full = settled(lambda p: client.complete(p.token_ids, 1).first_token_s)
            ttft["vllm_full"] = [full(p) for p in measured]
            connector = settled(lambda p: _through_connector(engine, exchange, client, p))
            ttft["vllm_connector"] = [connector(p) for p in measured]
        with _vllm(model_path, work, "vllm-apc", None, prefix_caching=True) as server:
            client = VllmClient(_url(server), SERVED_NAME)
            client.complete(pairs[0][0].token_ids, 1)
            apc = settled(lambda p: client.complete(p.token_ids, 1).first_token_s)
            ttft["vllm_apc"] = []
            for first, second in pairs:
                client.complete(first.token_ids, 1)  # warms system + this user's history
                ttft["vllm_apc"].append(apc(second))
    baseline = statistics.median(ttft["vllm_apc"])
    rows: list[Row] = [
        {"mode": mode, "ttft_ms": _median_ms(values),
         "speedup_vs_vllm_apc": round(baseline / statistics.median(values), 2)}
        for mode, values in ttft.items()
    ]
    print(f"{'mode':<16} {'ttft_ms':>10} {'speedup_vs_vllm_apc':>20}")
    for row in rows:
        print(f"{row['mode']!s:<16} {row['ttft_ms']:>10} {row['speedup_vs_vllm_apc']:>20}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


def _through_connector(engine: BlendEngine, exchange: KVExchange, client: VllmClient, prompt: Prompt) -> float:
    """Blend + exchange write + vLLM's first streamed token, as the sidecar serves it."""
    started = time.perf_counter()
    result = engine.blend(prompt)
    n = result.num_tokens
    exchange.write(prompt.token_ids, result.kv.keys[:, :, :n], result.kv.values[:, :, :n])
    completion = client.complete(prompt.token_ids, 1)
    exchange.remove(prompt.token_ids)
    return (time.perf_counter() - started) - completion.total_s + completion.first_token_s


