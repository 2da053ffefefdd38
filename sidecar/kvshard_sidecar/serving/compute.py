"""Where a request's numbers come from: the embedded engine, or vLLM — with the engine's blended KV, or alone.

Why a module of its own: a built prompt becomes label scores (rank mode) or decoded tokens (generate mode)
along one of three paths, and only this module tells them apart. The embedded engine blends and reads its
own logits; with ``--engine vllm`` an answer-position model is blended here and its prompt KV handed to
vLLM through the exchange, and a scorer model is computed by vLLM entirely
(:mod:`kvshard_sidecar.vllm.scorer`). vLLM down, restarting or refusing is the server's condition, not a
crash: a JSON 503 naming it. What comes back is typed, whichever path ran.
"""

from __future__ import annotations

import contextlib
import http.client
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvshard.prompts import RecommendationPrompt
from kvshard.request_errors import RequestError
from kvshard_sidecar.engine.isolated_scorer import scoring_prompt
from kvshard_sidecar.serving.calls import RecommendCall
from kvshard_sidecar.serving.model_host import ModelHost
from kvshard_sidecar.vllm.client import Completion

if TYPE_CHECKING:
    from kvshard_sidecar.engine.blend import BlendEngine
    from kvshard_sidecar.engine.results import BlendResult


class Prefill(Protocol):
    """How a prompt was prefilled, whoever did it (the engine's ``BlendResult``, vLLM's ``VllmScores``)."""

    @property
    def ttft_s(self) -> float: ...
    @property
    def timings(self) -> dict[str, float]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def recomputed_tokens(self) -> int: ...
    @property
    def recompute_ratio(self) -> float: ...
    @property
    def query_tokens(self) -> dict[str, int]: ...
    @property
    def hit_tokens(self) -> dict[str, dict[str, int]]: ...
    @property
    def computed_tokens(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class Computed:
    """What every path reports: the prefill, the time to the first token, extra timings (ms), and — when
    the embedded engine answered alone — its result (what a shadow check compares a full prefill with)."""

    prefill: Prefill
    ttft_s: float
    extra: dict[str, float]
    alone: BlendResult | None


@dataclass(frozen=True)
class Scored(Computed):
    """Rank mode: each candidate's label score, in candidate order."""

    scores: list[float]


@dataclass(frozen=True)
class Generated(Computed):
    """Generate mode: the decoded tokens and text, and the first token's most likely tokens (most first)."""

    token_ids: list[int]
    text: str
    top: dict[int, float]


class Computation:
    """Runs one built prompt on whatever the host computes with (worker thread, one request at a time)."""

    def __init__(self, host: ModelHost, vllm_url: str) -> None:
        self.host = host
        self.vllm_url = vllm_url

    def _engine(self) -> BlendEngine:
        assert self.host.engine is not None, "load() first"
        return self.host.engine

    def label_scores(self, built: RecommendationPrompt, call: RecommendCall) -> Scored:
        """Each candidate's label score at the answer position: the embedded engine's logits, or
        vLLM's full-vocabulary log-probabilities of the label tokens (same order up to a constant) —
        or, for a scorer model, each candidate's score read alone (:meth:`_scores_through_vllm`)."""
        host, labels = self.host, built.label_token_ids
        if host.readout is not None:
            if host.vllm is not None:
                return self._scores_through_vllm(built)
            result = self._engine().blend(scoring_prompt(built), call.blend, readout=host.readout)
            assert result.scores is not None
            return Scored(result, result.ttft_s, {}, result, result.scores.tolist())
        if host.vllm is None:
            result = self._engine().blend(built.prompt, call.blend)
            return Scored(result, result.ttft_s, {}, result, result.logits[list(labels)].tolist())
        vllm = host.vllm
        result, completion, ttft_s, extra = self._through_vllm(
            built, call, lambda tokens: vllm.label_logprobs(tokens, labels))
        return Scored(result, ttft_s, extra, None, [completion.top_logprobs[t] for t in labels])

    def _scores_through_vllm(self, built: RecommendationPrompt) -> Scored:
        """A scorer through vLLM, which does all the math: the item blocks made local (or computed by
        vLLM), then the K candidate prompts in one batch, their item bodies loaded by the connector
        (:mod:`kvshard_sidecar.vllm.scorer`). Exact whatever the blend settings: nothing is blended."""
        assert self.host.vllm_scorer is not None
        with self._vllm_answers():
            scored = self.host.vllm_scorer.score(scoring_prompt(built))
        extra = {"vllm_first_token_ms": round(scored.first_token_s * 1000, 3)}
        return Scored(scored, scored.ttft_s, extra, None, scored.scores)

    def generate(self, built: RecommendationPrompt, call: RecommendCall) -> Generated:
        """Free decoding: the embedded engine decodes on the blended KV, or vLLM does."""
        host = self.host
        if host.vllm is None:
            from kvshard_sidecar.engine.results import Sampling

            result, generation = self._engine().generate(
                built.prompt, call.max_tokens, call.blend, Sampling(temperature=call.temperature),
                stop_token_ids=host.eos)
            text = host.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
            return Generated(result, result.ttft_s, {}, result, generation.token_ids, text,
                             top_logprobs(result.logits, call.logprobs))
        vllm = host.vllm
        result, completion, ttft_s, extra = self._through_vllm(
            built, call, lambda tokens: vllm.complete(tokens, call.max_tokens, call.temperature, call.logprobs))
        ranked = sorted(completion.top_logprobs.items(), key=lambda pair: -pair[1])
        return Generated(result, ttft_s, extra, None, completion.token_ids, completion.text,
                         dict(ranked[: call.logprobs]))

    def _through_vllm(self, built: RecommendationPrompt, call: RecommendCall,
                      ask: Callable[[Sequence[int]], Completion]
                      ) -> tuple[BlendResult, Completion, float, dict[str, float]]:
        """Blend here, hand the prompt KV to vLLM through the exchange, and ask vLLM (``ask``)."""
        exchange = self.host.exchange
        assert exchange is not None
        result = self._engine().blend(built.prompt, call.blend)
        tokens = built.prompt.token_ids
        n = result.num_tokens
        started = time.perf_counter()
        exchange.write(tokens, result.kv.keys[:, :, :n], result.kv.values[:, :, :n])
        exchange_s = time.perf_counter() - started
        try:
            with self._vllm_answers():
                completion = ask(tokens)
        finally:
            exchange.remove(tokens)  # the connector removes it after loading; this covers failures
        ttft_s = result.ttft_s + exchange_s + completion.first_token_s
        extra = {"exchange_ms": round(exchange_s * 1000, 3),
                 "vllm_first_token_ms": round(completion.first_token_s * 1000, 3)}
        return result, completion, ttft_s, extra

    @contextlib.contextmanager
    def _vllm_answers(self) -> Iterator[None]:
        """vLLM down, restarting or refusing is the server's condition, not a crash: a JSON 503 naming it."""
        try:
            yield
        except (OSError, http.client.HTTPException, RuntimeError) as error:  # VllmRequestError is a RuntimeError
            raise RequestError("engine", f"vLLM at {self.vllm_url} did not answer: {error}",
                               status=503) from None


def top_logprobs(logits: torch.Tensor, count: int) -> dict[int, float]:
    """The ``count`` most likely first tokens with their log-probabilities (most likely first)."""
    if count <= 0:
        return {}
    values, indices = torch.topk(torch.log_softmax(logits.float(), dim=-1), count)
    return {int(i): float(v) for i, v in zip(indices.tolist(), values.tolist(), strict=True)}
