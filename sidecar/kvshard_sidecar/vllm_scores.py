"""A scorer model's candidates scored through vLLM: one request per candidate, sent at once.

Why it exists. A scorer (``scorer``, ``late``: :mod:`kvshard_sidecar.isolated_scorer`) scores each
candidate from the prefix and its own item alone, so vLLM — which serves causal prompts — is asked
``prefix + item + " ["`` once per candidate and returns ``log P(readout)`` at the last position. The
sidecar does it with the blended KV of those rows in the exchange (vLLM then computes only the label
opening), and ``kvshard bench vllm`` times the same requests with and without the exchange; both call
this module, so what the bench measures is what the sidecar serves.

Nothing here imports vLLM (the sidecar image need not ship it).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvshard_sidecar.engine.kvbuffer import KVBuffer
from kvshard_sidecar.exchange import KVExchange
from kvshard_sidecar.isolated_scorer import IsolatedInputs
from kvshard_sidecar.vllm_client import VllmClient


def candidate_rows(inputs: IsolatedInputs) -> list[list[int]]:
    """Per candidate, the rows of the scoring prompt its vLLM request holds: the prefix, then its item and
    the ``" ["`` that opens its label — the last row, where vLLM reads the score."""
    return [[*range(inputs.prefix), *range(start, opening + 1)]
            for (start, _), opening in zip(inputs.blocks, inputs.readouts, strict=True)]


@dataclass(frozen=True)
class VllmScores:
    """Each candidate's ``log P(readout)`` as vLLM returned it, with the time spent writing the exchange
    and the time until the last candidate's first token arrived (the requests run at once)."""

    scores: list[float]
    exchange_s: float
    first_token_s: float


def score_through_vllm(client: VllmClient, inputs: IsolatedInputs, readout: int,
                       blended: tuple[KVExchange, KVBuffer] | None = None) -> VllmScores:
    """Ask ``client`` for every candidate's score at once (vLLM batches them).

    With ``blended`` — the exchange and the scoring prompt's blended KV — each request's rows are written
    there first, so the connector loads them and vLLM computes only the label opening; without, vLLM
    prefills each request itself (its prefix cache, if on, sharing the prefix)."""
    asks = [(rows, [inputs.token_ids[row] for row in rows]) for rows in candidate_rows(inputs)]
    started = time.perf_counter()
    if blended is not None:
        exchange, kv = blended
        for rows, tokens in asks:
            exchange.write(tokens, kv.keys[:, :, rows], kv.values[:, :, rows])
    exchange_s = time.perf_counter() - started
    try:
        with ThreadPoolExecutor(len(asks), thread_name_prefix="vllm-scores") as pool:
            completions = list(pool.map(lambda ask: client.label_logprobs(ask[1], [readout]), asks))
    finally:
        if blended is not None:  # the connector removes each after loading; this covers failures
            for _, tokens in asks:
                blended[0].remove(tokens)
    return VllmScores([c.top_logprobs[readout] for c in completions], exchange_s,
                      max(c.first_token_s for c in completions))

