"""One ``POST /v1/recommend``, from the validated call to the JSON answer: prompt, numbers, ranking, metrics.

Why a module of its own: answering is the request path, and it is the same whichever engine computes —
build the prompt (cold items included) and check it fits, get the numbers (:mod:`.compute`), rank the
candidates or read the decoded label, count what was cached where, offer the request to the shadow checks,
and report it all in one answer whose shape is typed here (the HTTP API sends it as it is).
"""

from __future__ import annotations

import time
from typing import Literal, NotRequired, TypedDict, cast

from kvshard.prompts import PromptBuilder, RecommendationPrompt, RecommendationRequest
from kvshard.ranking import fuse_scores, rank_candidates
from kvshard.request_errors import RequestError
from kvshard_sidecar.engine.isolated_scorer import scoring_prompt
from kvshard_sidecar.metrics import SidecarMetrics
from kvshard_sidecar.serving.blend_state import BlendInForce
from kvshard_sidecar.serving.calls import RecommendCall
from kvshard_sidecar.serving.catalog_state import CatalogState
from kvshard_sidecar.serving.compute import Computation, Computed
from kvshard_sidecar.serving.model_host import ModelHost
from kvshard_sidecar.serving.shadow import ShadowChecker
from kvshard_sidecar.settings import SidecarSettings


class BlendJson(TypedDict):
    selector: str
    ratio: float


class TokensJson(TypedDict):
    prompt: int
    recomputed: int
    recompute_ratio: float
    query: dict[str, int]
    hit: dict[str, dict[str, int]]
    computed: dict[str, int]


class LogprobJson(TypedDict):
    token_id: int
    token: str
    logprob: float


class ServedJson(TypedDict):
    """What every answer reports after its mode's fields: who served it, how it was blended, how long it took."""

    engine: str
    model: str
    pod: str
    blend: BlendJson
    timings: dict[str, float]
    tokens: TokensJson


class RankAnswer(ServedJson):
    mode: Literal["rank"]
    label: str
    candidate: str
    ranking: list[dict[str, str | float]]
    retrieval_weight: NotRequired[float]
    """Present when the ranking fused the request's ``retrieval_scores``: the stage's weight it used."""


class GenerateAnswer(ServedJson):
    mode: Literal["generate"]
    text: str
    label: str | None
    candidate: str | None
    logprobs: list[LogprobJson]


RecommendAnswer = RankAnswer | GenerateAnswer


class Answerer:
    """Answers recommendation calls (worker thread, one at a time)."""

    def __init__(self, settings: SidecarSettings, host: ModelHost, catalog: CatalogState, blend: BlendInForce,
                 metrics: SidecarMetrics, shadow: ShadowChecker) -> None:
        self.settings = settings
        self.host = host
        self.catalog = catalog
        self.blend = blend
        self.metrics = metrics
        self.shadow = shadow
        self.compute = Computation(host, settings.vllm_url)

    def build(self, call: RecommendCall) -> RecommendationPrompt:
        """The call's prompt; its inline items the catalog lacks are counted as cold items."""
        request = RecommendationRequest(call.user_id, call.history, call.candidates)
        builder = self.catalog.builder
        inline = {item_id: item for item_id, item in call.inline.items() if item_id not in builder.dataset.items}
        try:
            if call.instruction is None:
                built = builder.build(request, inline)
            else:
                built = PromptBuilder(self.host.tokenizer, builder.dataset, question="\n" + call.instruction.strip(),
                                      template=builder.template).build(request, inline)
        except KeyError as error:  # an inline item without a field the template's item line uses
            raise RequestError("candidates", f"{error.args[0]}: spec.prompt.itemFormat "
                               f"{builder.template.item_format!r} needs it", status=422) from None
        if inline:
            self.metrics.cold_items.labels(self.host.name).inc(len(inline))
        context = self.host.context_tokens
        if len(built.prompt) + call.max_tokens > context:
            raise RequestError("history", f"the prompt has {len(built.prompt)} tokens; with max_tokens it must "
                               f"fit the {context} tokens this sidecar serves", status=413)
        return built

    def recommend(self, call: RecommendCall) -> RecommendAnswer:
        """Blend, rank the candidates or decode (here or in vLLM), and report what was cached where."""
        started = time.perf_counter()
        built = self.build(call)
        host = self.host
        if call.mode != "rank" and host.readout is not None:
            raise RequestError("mode", f"{host.name} ranks the candidates (the {host.scorer} scorer scores "
                               "each one alone) and does not generate: ask \"mode\": \"rank\"", status=422)
        if call.mode == "rank":
            scored = self.compute.label_scores(built, call)
            weight = host.retrieval_weight if call.retrieval_weight is None else call.retrieval_weight
            fused = None if call.retrieval_scores is None else fuse_scores(scored.scores, call.retrieval_scores, weight)
            ranking = rank_candidates(built.request.candidates, built.labels, scored.scores, fused)
            self._after(built, call, scored)
            # mypy cannot see that a non-required key may be missing from a ** item, hence the cast
            answer = cast(RankAnswer, {"mode": "rank", "label": ranking[0].label, "candidate": ranking[0].candidate,
                                       "ranking": [ranked.as_json() for ranked in ranking[: call.top_k]],
                                       **self._served(call, scored, started)})
            if fused is not None:
                answer["retrieval_weight"] = weight
            return answer
        generated = self.compute.generate(built, call)
        tokenizer = host.tokenizer
        label = tokenizer.decode(generated.token_ids[:1]).strip()
        logprobs: list[LogprobJson] = [
            {"token_id": t, "token": tokenizer.decode([t]), "logprob": round(v, 6)} for t, v in generated.top.items()]
        self._after(built, call, generated)
        return {"mode": "generate", "text": generated.text, "label": label if label in built.labels else None,
                "candidate": built.candidate_for_label(label), "logprobs": logprobs,
                **self._served(call, generated, started)}

    def _served(self, call: RecommendCall, computed: Computed, started: float) -> ServedJson:
        result = computed.prefill
        return {
            "engine": self.settings.engine,
            "model": self.host.name,
            "pod": self.settings.name,
            "blend": {"selector": call.blend.selector, "ratio": call.blend.ratio},
            "timings": {"ttft_ms": round(computed.ttft_s * 1000, 3),
                        "total_ms": round((time.perf_counter() - started) * 1000, 3),
                        "blend_ms": round(result.ttft_s * 1000, 3), **computed.extra,
                        **{f"{k}_ms": round(v * 1000, 3) for k, v in result.timings.items()}},
            "tokens": {"prompt": result.num_tokens, "recomputed": result.recomputed_tokens,
                       "recompute_ratio": round(result.recompute_ratio, 4), "query": result.query_tokens,
                       "hit": result.hit_tokens, "computed": result.computed_tokens},
        }

    def _after(self, built: RecommendationPrompt, call: RecommendCall, computed: Computed) -> None:
        """Count the request (time to first token, recompute, tokens by kind and tier) and offer it to the
        shadow checks."""
        result, ttft_s = computed.prefill, computed.ttft_s
        metrics, name = self.metrics, self.host.name
        metrics.ttft.labels(name).observe(ttft_s)
        metrics.pressure.observe_ttft(ttft_s)
        metrics.recompute_ratio.labels(name).observe(result.recompute_ratio)
        for kind, count in result.query_tokens.items():
            metrics.query_tokens.labels(name, kind).inc(count)
        for kind, tiers in result.hit_tokens.items():
            for tier, count in tiers.items():
                metrics.hit_tokens.labels(name, kind, tier).inc(count)
        self._offer_shadow(built, call, computed)

    def _offer_shadow(self, built: RecommendationPrompt, call: RecommendCall, computed: Computed) -> None:
        """Sample a request blended with the settings in force for a shadow check (embedded engine alone). A
        scorer's check compares the candidates' scores (its KL is over their softmax)."""
        alone = computed.alone
        if alone is not None and call.blend == self.blend.defaults:
            policy = self.blend.policy
            if alone.scores is not None:  # a scorer model
                self.shadow.offer(scoring_prompt(built), tuple(range(len(alone.scores))), alone.scores,
                                  policy.method, policy.ratio)
                return
            self.shadow.offer(built.prompt, tuple(built.label_token_ids), alone.logits, policy.method, policy.ratio)
