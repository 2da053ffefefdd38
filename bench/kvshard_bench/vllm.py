"""``kvshard bench vllm``: TTFT through vLLM + KvshardConnector, side by side with the alternatives.

All modes serve the same MovieLens prompts, measured in one run:

* ``vllm_apc`` — plain vLLM with automatic prefix caching: each user's first request warms vLLM's
  cache, the second (same history, new candidates) is measured, so system + history are a prefix
  hit and vLLM prefills the candidates and question. The baseline a production stack has today.
* ``vllm_full`` — the same vLLM with the connector but no exchange entry: a full prefill (answer-position
  models; a scorer's connector server keeps its prefix cache on, so it has no full-prefill row).
* ``embedded`` — kvshard's blend engine answers itself (blocks warm).
* ``vllm_connector`` — an answer-position model: kvshard blends (blocks warm), writes the prompt KV to
  the exchange, vLLM loads it through the connector and computes only the last prompt token; TTFT =
  blend + exchange write + vLLM's first streamed token. A scorer: vLLM does all the math
  (:class:`~kvshard_sidecar.vllm.scorer.VllmScorer`): the K candidate prompts in one batch, item bodies
  loaded from the blocks vLLM stored when the user's first request warmed them, the prefix from vLLM's
  prefix cache; TTFT = block checks + that request.

Each model is asked the way the sidecar asks it (:class:`Asking`): an answer-position model
(``finetuned``, ``base``) as one prompt whose first token answers; a scorer (``late``, the default, and
``scorer``) as one batched vLLM request of K prompts, ``prefix + item + " ["``, TTFT being the batch's.
Every row also reports ``top1_agreement``: how often the mode's answer
(the token, or the best-scored candidate) is the embedded engine's full prefill's. For the late scorer
that column is what only kvshard can serve: its item tokens were trained to read only themselves, which
a plain causal prefill (``vllm_full``, ``vllm_apc``) does not do, so plain vLLM times the same work
but does not answer as the model does; the connector, handed KV computed with the model's own mask, does.

Requests are measured one at a time with ``--gap-seconds`` of idle time before each, in every mode:
on this 2-core machine vLLM's CPU worker keeps a core busy for about a second after it answers, and
a blend started in that second runs 4x slower — an artifact of sharing two cores, not of either
path. TTFT here is single-request latency at low load.

Two vLLM servers run one after the other (one with the connector — no prefix cache for an
answer-position model, so blended KV never leaks into its cache; the prefix cache on for a scorer, whose
loads are exact — and one plain with prefix caching), each started and stopped here.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvshard.blend_policy import from_spec
from kvshard.datasets import Dataset, load_dataset
from kvshard.models import MEASURED_MODEL, MODEL_HELP, model_blend, model_scorer, model_template, resolve_model
from kvshard.processes import ManagedProcess
from kvshard.prompts import PromptBuilder, RecommendationPrompt, RecommendationRequest, sample_requests
from kvshard.ranking import best_index
from kvshard.segments import Prompt
from kvshard_local.testing_servers import free_port
from kvshard_sidecar.blockstore import BlockStore
from kvshard_sidecar.engine.blend import BlendEngine
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, Readout, prefill_context_for, scoring_prompt
from kvshard_sidecar.engine.methods import METHODS, method_settings
from kvshard_sidecar.engine.model import load_model
from kvshard_sidecar.engine.results import BlendResult
from kvshard_sidecar.engine.settings import BlendSettings
from kvshard_sidecar.engine.source import MemoryBlockSource
from kvshard_sidecar.vllm.client import VllmClient, server_command
from kvshard_sidecar.vllm.exchange import KVExchange
from kvshard_sidecar.vllm.scorer import VllmScorer, score_causal

Row = dict[str, object]
SERVED_NAME = "kvshard-bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="movielens-100k", help="built-in name or folder (default: %(default)s)")
    parser.add_argument("--model", default=None, metavar="late|finetuned|scorer|base|PATH",
                        help=f"{MODEL_HELP} (default: {MEASURED_MODEL})")
    parser.add_argument("--users", type=int, default=6, help="users, two requests each (default: %(default)s)")
    parser.add_argument("--history", type=int, default=30, help="history items (default: %(default)s)")
    parser.add_argument("--candidates", type=int, default=20, help="candidates (default: %(default)s)")
    parser.add_argument("--method", "--selector", dest="method", default=None, choices=list(METHODS),
                        help="blend method of the embedded and connector modes (default: the one `kvshard up` gives "
                             "the model's CacheShard: 'none' for a late scorer, whose cache is exact, else kvshard's "
                             "default)")
    parser.add_argument("--ratio", type=float, default=None,
                        help="recompute ratio (default: the model's, as for --method)")
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


def _vllm(model: Path, work: Path, name: str, exchange: Path | None, prefix_caching: bool,
          block_dir: Path | None = None) -> ManagedProcess:
    port = free_port()
    return ManagedProcess(
        server_command(sys.executable, model, port, exchange_dir=exchange, prefix_caching=prefix_caching,
                       served_name=SERVED_NAME, block_dir=block_dir),
        work / f"{name}.log", f"http://127.0.0.1:{port}/health",
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}, start_timeout=600)


def _url(process: ManagedProcess) -> str:
    return process.ready_url.rsplit("/", 1)[0]


def _median_ms(values: Sequence[float]) -> float:
    return round(statistics.median(values) * 1000, 2)


def run(args: argparse.Namespace) -> list[Row]:
    dataset = load_dataset(args.dataset)
    model = resolve_model(args.model, MEASURED_MODEL)
    loaded = load_model(model)
    asking = Asking.for_model(loaded.tokenizer, model)
    builder = PromptBuilder(loaded.tokenizer, dataset, template=model_template(model))
    firsts = sample_requests(dataset, args.users, args.history, args.candidates, seed=args.seed)
    pairs = [(asking.prompt(builder.build(r)),
              asking.prompt(builder.build(other_candidates(r, dataset, args.seed + i)))) for i, r in enumerate(firsts)]
    settings = BlendSettings(prefill_context=prefill_context_for(model_scorer(model)))
    ratio = asking.ratio if args.ratio is None else args.ratio
    engine = BlendEngine(loaded.model, loaded.identity, MemoryBlockSource(),
                         method_settings(args.method or asking.method, ratio, settings))
    for first, second in tqdm(pairs, desc="warm blocks", unit="user"):
        engine.blend(first, readout=asking.readout)
        engine.blend(second, readout=asking.readout)
    measured = [second for _, second in pairs]
    reference = [asking.answer(engine.full(p, readout=asking.readout)) for p in measured]
    print(f"{len(measured)} measured prompts, {statistics.mean(len(p) for p in measured):.0f} tokens on average, "
          f"{asking.what}; blended with {engine.settings.selector} at r = {engine.settings.ratio}")

    def settled(measure: Callable[[Prompt], Answered], before: Callable[[int], object] = lambda _: None
                ) -> list[Answered]:
        """Each measured prompt after ``before(its index)`` and ``--gap-seconds`` of idle time."""
        answered = []
        for index, prompt in enumerate(measured):
            before(index)
            time.sleep(args.gap_seconds)
            answered.append(measure(prompt))
        return answered

    def embedded(prompt: Prompt) -> Answered:
        result = engine.blend(prompt, readout=asking.readout)
        return result.ttft_s, asking.answer(result)

    runs: dict[str, list[Answered]] = {"embedded": settled(embedded)}
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None  # the exchange lives in shared memory in a pod
    with tempfile.TemporaryDirectory(prefix="kvshard-bench-vllm-") as scratch, \
            tempfile.TemporaryDirectory(prefix="kvshard-bench-exchange-", dir=shm) as exchange_scratch:
        work = Path(scratch)
        exchange = KVExchange(Path(exchange_scratch))
        scorer = asking.readout is not None
        blocks = work / "blocks"
        with _vllm(loaded.path, work, "vllm-connector", Path(exchange_scratch), prefix_caching=scorer,
                   block_dir=blocks) as server:
            client = VllmClient(_url(server), SERVED_NAME)
            if scorer:
                assert asking.readout is not None
                path = VllmScorer(client, BlockStore(1 << 30, blocks, 1 << 34), loaded.identity,
                                  asking.readout.token, asking.readout.interaction)
                for first, second in pairs:  # the blocks of both requests, as the embedded pass warms them;
                    path.ensure(path.blocks_of(second))  # the first request also warms vLLM's prefix cache
                    path.score(first)
                runs["vllm_connector"] = settled(lambda p: asking.computed_by_vllm(path, p))
            else:
                asking.vllm(client, measured[0])  # the first request pays vLLM's lazy warm-up
                runs["vllm_full"] = settled(lambda p: asking.vllm(client, p))
                runs["vllm_connector"] = settled(lambda p: asking.connector(engine, exchange, client, p))
        with _vllm(loaded.path, work, "vllm-apc", None, prefix_caching=True) as server:
            client = VllmClient(_url(server), SERVED_NAME)
            asking.vllm(client, pairs[0][0])
            # each user's first prompt warms system + history; its second is measured
            runs["vllm_apc"] = settled(lambda p: asking.vllm(client, p), lambda i: asking.vllm(client, pairs[i][0]))
    baseline = statistics.median(t for t, _ in runs["vllm_apc"])
    rows: list[Row] = [
        {"mode": mode, "ttft_ms": _median_ms([t for t, _ in answered]),
         "speedup_vs_vllm_apc": round(baseline / statistics.median(t for t, _ in answered), 2),
         "top1_agreement": round(statistics.mean(float(a == r)
                                                 for (_, a), r in zip(answered, reference, strict=True)), 3),
         "model": loaded.path.name, "answer": asking.what}
        for mode, answered in runs.items()
    ]
    print(f"{'mode':<16} {'ttft_ms':>10} {'speedup_vs_vllm_apc':>20} {'top1_agreement':>15}")
    for row in rows:
        print(f"{row['mode']!s:<16} {row['ttft_ms']:>10} {row['speedup_vs_vllm_apc']:>20} {row['top1_agreement']:>15}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


Answered = tuple[float, int]
"""One measured request: its time to first token (seconds) and what it answered (a token id, or the chosen
candidate's index for a scorer)."""


@dataclass(frozen=True)
class Asking:
    """How this model is asked, by every mode alike: an answer-position model is one prompt whose first
    token is the answer; a scorer (``scorer``, ``late``) is one prompt per candidate, sent as one batch
    (``prefix + item + " ["``, :mod:`kvshard_sidecar.vllm.scorer`) whose best score is the answer — the sidecar's
    two paths."""

    readout: Readout | None
    method: str
    ratio: float

    @classmethod
    def for_model(cls, tokenizer: Any, model: Path) -> Asking:
        """The model's way of being asked, and the blend its CacheShard would get from ``kvshard up``
        (:func:`kvshard.models.model_blend`: ``none`` at 0 for a late scorer, whose cache is exact)."""
        policy = from_spec({"blend": model_blend(model)})
        return cls(Readout.for_model(tokenizer, model), policy.method, policy.ratio)

    @property
    def what(self) -> str:
        return "first token" if self.readout is None else "chosen candidate (the K candidate prompts, one batch)"

    def prompt(self, built: RecommendationPrompt) -> Prompt:
        return built.prompt if self.readout is None else scoring_prompt(built)

    def answer(self, result: BlendResult) -> int:
        if self.readout is None:
            return int(result.logits.argmax())
        if result.scores is None:
            raise ValueError("a scorer's result carries no scores")
        return best_index(result.scores.tolist())

    def vllm(self, client: VllmClient, prompt: Prompt) -> Answered:
        """vLLM prefills the request(s) itself (from its prefix cache, if on)."""
        if self.readout is None:
            completion = client.complete(prompt.token_ids, 1)
            return completion.first_token_s, completion.token_ids[0]
        scored = score_causal(client, IsolatedInputs.of_prompt(prompt), self.readout.token)
        return scored.first_token_s, best_index(scored.scores)

    def computed_by_vllm(self, path: VllmScorer, prompt: Prompt) -> Answered:
        """A scorer as the sidecar serves it with ``--engine vllm``: no forward here, one batch in vLLM."""
        scored = path.score(prompt)
        return scored.ttft_s, best_index(scored.scores)

    def connector(self, engine: BlendEngine, exchange: KVExchange, client: VllmClient, prompt: Prompt) -> Answered:
        """Blend + exchange write + vLLM's first streamed token, as the sidecar serves an answer model."""
        started = time.perf_counter()
        result = engine.blend(prompt, readout=self.readout)
        n = result.num_tokens
        exchange.write(prompt.token_ids, result.kv.keys[:, :, :n], result.kv.values[:, :, :n])
        completion = client.complete(prompt.token_ids, 1)
        exchange.remove(prompt.token_ids)
        return (time.perf_counter() - started) - completion.total_s + completion.first_token_s, completion.token_ids[0]

