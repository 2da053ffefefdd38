"""A scorer model's candidates scored by vLLM, which does all the math, from the pod's stored blocks.

Why it exists. A scorer (``scorer``, ``late``: :mod:`kvshard_sidecar.engine.isolated_scorer`) scores each
candidate from the causal prompt ``prefix + item + " ["`` — the shape vLLM serves natively. So on a
GPU pod the sidecar runs no forward at all (it holds the tokenizer, not the weights):

1. it makes sure every item body's block is local — memory, disk, then peers, fetched concurrently —
   and has vLLM compute the missing ones: the item prompted alone, stored by the connector's save
   path (:mod:`kvshard_sidecar.vllm.plan`); the same for the prefix (system, history, header), whose
   rows the connector needs wherever vLLM's prefix cache stops short of the prefix's end;
2. it sends the K candidate prompts as **one** batched completion whose plan names, per item, the
   block that holds its body: the connector loads those rows (keys rotated to where the item stands)
   and vLLM computes, batched, only each candidate's last ``interaction`` item tokens and its label
   opening, and returns ``log P(" yes")`` there.

For ``late`` that is exactly the model's own computation (its item bodies read only their item); for
``isolated`` no body is loaded (its items read the prefix) and vLLM computes each candidate after the
shared prefix, which is again exact. ``score_causal`` asks plain vLLM the same prompts without a plan
(what a team without kvshard serves, with vLLM's prefix cache), for the benchmarks.

Nothing here imports vLLM (the sidecar image need not ship it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvshard.segments import ModelIdentity, Prompt, Segment, SegmentKind, block_key
from kvshard_sidecar.blockstore import BlockStore
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs
from kvshard_sidecar.vllm.client import VllmClient, VllmRequestError
from kvshard_sidecar.vllm.plan import BlockRows, digest, load_plan, save_plan

log = logging.getLogger(__name__)

PREFIX_CONTEXT = "vllm-prefix"
"""The key context of a prefix block vLLM computed (causal from position 0: one name, never an item's)."""


def candidate_rows(inputs: IsolatedInputs) -> list[list[int]]:
    """Per candidate, the rows of the scoring prompt its vLLM prompt holds: the prefix, then its item and
    the ``" ["`` that opens its label — the last row, where vLLM reads the score."""
    return [[*range(inputs.prefix), *range(start, opening + 1)]
            for (start, _), opening in zip(inputs.blocks, inputs.readouts, strict=True)]


def candidate_prompts(inputs: IsolatedInputs) -> list[list[int]]:
    """The K causal prompts ``prefix + item + " ["`` (token ids)."""
    return [[inputs.token_ids[row] for row in rows] for rows in candidate_rows(inputs)]


@dataclass(frozen=True)
class VllmScores:
    """Each candidate's ``log P(readout)`` as vLLM returned it, the time spent making blocks local
    (``blocks_s``: fetches and vLLM warming) and the time of the scoring request itself, with the token
    accounting the sidecar reports and counts (the fields of the engine's result it reads)."""

    scores: list[float]
    blocks_s: float
    first_token_s: float
    num_tokens: int = 0
    recomputed_tokens: int = 0
    """Tokens vLLM computed for the candidates (the rows no block held)."""
    query_tokens: dict[str, int] = field(default_factory=dict)
    hit_tokens: dict[str, dict[str, int]] = field(default_factory=dict)
    computed_tokens: dict[str, int] = field(default_factory=dict)
    """Tokens of blocks vLLM computed for this request (items and the prefix not stored before)."""

    @property
    def ttft_s(self) -> float:
        return self.blocks_s + self.first_token_s

    @property
    def recompute_ratio(self) -> float:
        return self.recomputed_tokens / self.num_tokens if self.num_tokens else 0.0

    @property
    def timings(self) -> dict[str, float]:
        return {"blocks": self.blocks_s, "vllm": self.first_token_s}


def score_causal(client: VllmClient, inputs: IsolatedInputs, readout: int) -> VllmScores:
    """Plain vLLM: the K candidate prompts in one batch, each computed causally (its prefix cache, if on,
    sharing the prefix). Exact for ``isolated``; for ``late`` the item bodies read the prefix, which the
    model was not trained to do (the benchmarks' baseline)."""
    started = time.perf_counter()
    scores = client.batch_logprobs(candidate_prompts(inputs), readout)
    return VllmScores(scores, 0.0, time.perf_counter() - started)


class VllmScorer:
    """Scores a scoring prompt (:func:`~kvshard_sidecar.engine.isolated_scorer.scoring_prompt`) through vLLM from
    the pod's block store; safe to call from several threads at once (vLLM batches their requests)."""

    def __init__(self, client: VllmClient, store: BlockStore, identity: ModelIdentity, readout: int,
                 interaction: int | None, fetch_threads: int = 8) -> None:
        if store.disk is None:
            raise ValueError("the vLLM scorer path needs the disk tier (--disk-dir): vLLM's connector reads and "
                             "writes blocks there")
        self.client, self.store, self.identity = client, store, identity
        self.readout, self.interaction = readout, interaction
        self._pool = ThreadPoolExecutor(fetch_threads, thread_name_prefix="block-fetch")

    def item_key(self, segment: Segment) -> str:
        """The key of an item's block: the item prefilled alone at position 0 (the engine's ``history``
        context stores item blocks under the same keys)."""
        return block_key(self.identity, segment, "")

    def prefix_key(self, token_ids: Sequence[int]) -> str:
        return block_key(self.identity, Segment(SegmentKind.FREE, tuple(token_ids)), PREFIX_CONTEXT)

    def body_tokens(self, item_tokens: int) -> int:
        """Rows of an item that read only their item and so load from its block (``late``); 0 for
        ``isolated``, whose items read the prefix."""
        return 0 if self.interaction is None else max(0, item_tokens - self.interaction)

    def blocks_of(self, prompt: Prompt) -> dict[str, list[int]]:
        """The blocks scoring ``prompt`` loads — its prefix and (``late``) its items' bodies — each key with
        the tokens vLLM computes it from, alone."""
        inputs = IsolatedInputs.of_prompt(prompt, self.interaction)
        prefix_tokens = list(inputs.token_ids[: inputs.prefix])
        return {self.prefix_key(prefix_tokens): prefix_tokens,
                **{self.item_key(segment): list(segment.token_ids) for segment in prompt.segments
                   if segment.kind is SegmentKind.ITEM and self.body_tokens(len(segment)) > 0}}

    def score(self, prompt: Prompt) -> VllmScores:
        inputs = IsolatedInputs.of_prompt(prompt, self.interaction)
        started = time.perf_counter()
        items = [segment for segment in prompt.segments if segment.kind is SegmentKind.ITEM]
        prefix_tokens = list(inputs.token_ids[: inputs.prefix])
        prefix = BlockRows(self.prefix_key(prefix_tokens), len(prefix_tokens))
        bodies = {digest(segment.token_ids): BlockRows(self.item_key(segment), self.body_tokens(len(segment)))
                  for segment in items if self.body_tokens(len(segment)) > 0}
        wanted = self.blocks_of(prompt)
        warmed = self.ensure(wanted)
        blocks_s = time.perf_counter() - started
        plan = load_plan(len(prefix_tokens), prefix, bodies).as_params()
        prompts = candidate_prompts(inputs)
        asked = time.perf_counter()
        try:
            scores = self.client.batch_logprobs(prompts, self.readout, plan)
        except VllmRequestError as error:
            # a block evicted or damaged between the check and vLLM's load: warm again, ask once more
            log.warning("vLLM could not score from the stored blocks (%s); warming them again", error)
            for key in wanted:
                self.store.disk.get(key)  # type: ignore[union-attr]  # verifies; a corrupt file is removed
            warmed |= self.ensure(wanted)
            scores = self.client.batch_logprobs(prompts, self.readout, plan)
        loaded = sum(rows.tokens for rows in bodies.values())
        body_hits = sum(rows.tokens for rows in bodies.values() if rows.key not in warmed)
        computed = {"item": sum(len(segment) for segment in items if self.item_key(segment) in warmed),
                    "prefix": len(prefix_tokens) if prefix.key in warmed else 0}
        return VllmScores(scores, blocks_s, time.perf_counter() - asked, num_tokens=len(prompt),
                          recomputed_tokens=sum(len(p) for p in prompts) - len(prompts) * len(prefix_tokens) - loaded,
                          query_tokens={kind.value: count for kind, count in prompt.tokens_by_kind().items()},
                          hit_tokens={"item": {"disk": body_hits}} if body_hits else {},
                          computed_tokens={kind: count for kind, count in computed.items() if count})

    def ensure(self, wanted: dict[str, list[int]]) -> set[str]:
        """Make the blocks ``wanted`` (key → the tokens vLLM computes it from, alone) local: the disk tier,
        else a peer (fetched concurrently), else vLLM computes them in one batch and its connector stores
        them. Returns the keys vLLM computed; raises ``RuntimeError`` if vLLM did not store them."""
        disk = self.store.disk
        assert disk is not None
        missing = [key for key in wanted if not disk.contains(key)]
        if missing:
            fetched = list(self._pool.map(lambda key: self.store.get(key) is not None, missing))
            missing = [key for key, found in zip(missing, fetched, strict=True) if not found or not disk.contains(key)]
        if not missing:
            return set()
        saves = {digest(wanted[key]): BlockRows(key, len(wanted[key])) for key in missing}
        self.client.batch_logprobs([wanted[key] for key in missing], self.readout, save_plan(saves).as_params())
        absent = [key for key in missing if not disk.contains(key)]
        if absent:
            raise RuntimeError(f"vLLM computed {len(missing)} blocks but its connector stored "
                               f"{len(missing) - len(absent)} (is block_dir the sidecar's --disk-dir, and could "
                               "the connector read vLLM's KV cache? see vLLM's log)")
        return set(missing)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
