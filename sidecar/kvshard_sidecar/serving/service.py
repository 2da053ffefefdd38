"""What one sidecar does, without HTTP: load the model, blend and decode requests, warm blocks.

The HTTP layer (``app.py``) validates and admits; this module owns the model, the block store and
the blend engine, and is called from one worker thread at a time, so the engine needs no locks.

The catalog and the prompt template come from the followed CacheShard: the placement generation
names a catalog version and carries ``spec.prompt``, and :meth:`SidecarService.use_catalog` switches
to them (while no request computes). ``--dataset`` is the catalog of a sidecar that follows nothing,
and of one whose generations name no catalog (written by an operator older than catalog versions).
Items a request brings inline (``{"id", "text"}``) and the catalog lacks are *cold items*: their
blocks are computed on the request, stored like any other, and counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvshard.blend_policy import BlendPolicy
from kvshard.catalog_schema import Catalog
from kvshard.datasets import Dataset, DatasetError, Item, load_dataset
from kvshard.models import model_prompt, model_scorer, prompt_for_model, resolve_model
from kvshard.prompt_template import PromptTemplate
from kvshard.prompts import PromptBuilder, RecommendationPrompt, RecommendationRequest
from kvshard.ranking import rank_candidates
from kvshard.request_errors import RequestError
from kvshard.segments import ModelIdentity, Prompt
from kvshard_sidecar.blockstore import BlockStore, encode_block
from kvshard_sidecar.blockstore.peers import HoldersOf, PeerFetcher, PlacementHolders, static_holders
from kvshard_sidecar.engine.contexts import segment_keys
from kvshard_sidecar.engine.isolated_scorer import Readout, prefill_context_for, scoring_prompt
from kvshard_sidecar.engine.methods import method_settings
from kvshard_sidecar.engine.settings import BlendSettings
from kvshard_sidecar.metrics import SidecarMetrics
from kvshard_sidecar.pressure import PressureTracker
from kvshard_sidecar.serving.calls import Limits, RecommendCall
from kvshard_sidecar.serving.prefill_queue import PrefillQueue, WarmUnit
from kvshard_sidecar.serving.shadow import ShadowChecker
from kvshard_sidecar.settings import SidecarSettings
from kvshard_sidecar.vllm.client import Completion, VllmClient
from kvshard_sidecar.vllm.exchange import KVExchange
from kvshard_sidecar.vllm.scorer import VllmScorer

log = logging.getLogger(__name__)


class SidecarService:
    """The model, store and engine of one pod; ``load`` runs once, in the worker thread."""

    def __init__(self, settings: SidecarSettings) -> None:
        self.settings = settings
        self.limits = Limits(settings.max_candidates, settings.max_history, settings.max_new_tokens)
        self.peer_token = settings.token()
        # Following placement, peers are whoever placement and the warm reports name; else --peers.
        self.holders = PlacementHolders(settings.name) if settings.etcd_endpoints else None
        holders: HoldersOf | None = self.holders or (static_holders(settings.peers) if settings.peers else None)
        fetcher = None
        if holders is not None and self.peer_token:
            fetcher = PeerFetcher(holders, self.peer_token, settings.peer_timeout_seconds)
        self.store = BlockStore(settings.memory_bytes, settings.disk_root, settings.disk_bytes, fetcher)
        self.model_path = resolve_model(settings.model)
        self.model_name = self.model_path.name
        # a fine-tuned model is asked as it was trained (its label position) unless a CacheShard says otherwise
        self.trained_prompt = model_prompt(self.model_path)
        self.scorer = model_scorer(self.model_path)
        """How the model ranks (:data:`kvshard.models.SCORERS`): at the answer position, or each candidate
        scored alone (:mod:`kvshard_sidecar.engine.isolated_scorer`, embedded engine only)."""
        self.readout: Readout | None = None
        self.vllm_computes = settings.engine == "vllm" and self.scorer != "answer"
        """A scorer served with ``--engine vllm``: vLLM does all the math (:mod:`kvshard_sidecar.vllm.scorer`),
        this process holds the tokenizer, never the weights, and admits ``vllm_concurrency`` requests."""
        self.concurrency = settings.vllm_concurrency if self.vllm_computes else settings.max_concurrency
        self.metrics = SidecarMetrics(self.model_name, self.store.stats, cacheshard=settings.cacheshard,
                                      pressure=PressureTracker(self.concurrency, settings.ttft_target_seconds,
                                                               settings.pressure_window_seconds))
        self.prefill_queue = PrefillQueue(self)
        self.ready = False
        self.load_error = ""
        self.items: Mapping[str, Item] = {}
        self.users: Mapping[str, list[str]] = {}
        self.blend_policy = BlendPolicy(settings.method, settings.ratio, settings.shadow_sample_rate, "Flags")
        """The blend settings in force: the flags', until the followed CacheShard publishes its own."""
        self.blend_defaults = self._blend_settings(self.blend_policy)
        self.blend_known = not settings.etcd_endpoints
        """Whether the blend in force is known: at once without a CacheShard; following one, once its
        published blend (or that there is none) was read from etcd (:meth:`blend_read`)."""
        self.loaded_at: float | None = None
        """``time.monotonic()`` when the model finished loading."""
        self.shadow = ShadowChecker(self.metrics, self._full_logits, budget_share=settings.shadow_budget_percent / 100,
                                    sample_rate=self.blend_policy.sample_rate)
        self.shadow.announce(self.blend_policy.method, self.blend_policy.ratio)
        self.item_block_keys: Mapping[str, str] = {}
        self.catalog_version = ""
        """The catalog version in use ("" = ``--dataset``)."""
        self.prompt_spec: Mapping[str, str] = {}
        """``spec.prompt`` in use ({} = the default template)."""
        self._identity: ModelIdentity | None = None
        self._dataset: Dataset | None = None
        self._builder: PromptBuilder | None = None
        self._engine: Any = None
        self._eos: set[int] = set()
        self._vllm: VllmClient | None = None
        self._exchange: KVExchange | None = None
        self._vllm_scorer: VllmScorer | None = None
        if settings.engine == "vllm":
            self._vllm = VllmClient(settings.vllm_url, settings.vllm_model or self.model_name)
            self._exchange = KVExchange(settings.exchange_dir)

    def load(self) -> None:
        """Load catalog and model (seconds); the API answers 503 until this returns."""
        from kvshard_sidecar.engine.blend import BlendEngine
        from kvshard_sidecar.engine.model import load_model, load_tokenizer

        try:
            self._dataset = load_dataset(self.settings.dataset)
        except DatasetError as error:
            if not self.settings.etcd_endpoints:
                raise
            # following a CacheShard, the catalog comes with the first generation
            log.warning("--dataset %s not loaded (%s); waiting for the CacheShard's catalog", self.settings.dataset,
                        error)
            self._dataset = Dataset(name="empty", items={})
        self.items, self.users = self._dataset.items, self._dataset.histories
        if self.vllm_computes:
            tokenizer, config, identity = load_tokenizer(self.model_path, self.settings.dtype)
        else:
            loaded = load_model(self.model_path, dtype=self.settings.dtype, device=self.settings.device)
            tokenizer, config, identity = loaded.tokenizer, loaded.config, loaded.identity
        self.model_name = identity.name
        self.metrics.model_name = self.model_name
        template = PromptTemplate.from_spec(self.trained_prompt)
        self._builder = PromptBuilder(tokenizer, self._dataset, template=template)
        self._identity = identity
        self.readout = Readout.for_model(tokenizer, self.model_path)
        if self.vllm_computes:
            assert self._vllm is not None and self.readout is not None
            self._vllm_scorer = VllmScorer(self._vllm, self.store, self.identity, self.readout.token,
                                           self.readout.interaction)
        else:
            self._engine = BlendEngine(loaded.model, self.identity, self.store, self.blend_defaults)
        eos = tokenizer.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        self.limits = Limits(min(self.settings.max_candidates, self._builder.max_candidates),
                             self.settings.max_history, self.settings.max_new_tokens,
                             num_layers=int(config.num_hidden_layers))
        context = int(getattr(config, "max_position_embeddings", 2048))
        self.context_tokens = min(context, self.settings.max_prompt_tokens or context)
        self.tokenizer = tokenizer
        self.item_block_keys = self._item_keys()
        self.metrics.catalog_items.labels(self.model_name).set(len(self.items))
        if self.holders is not None:
            self.holders.set_item_keys({key: item for item, key in self.item_block_keys.items()})
        self.metrics.ready.labels(self.model_name).set(1)
        self.loaded_at = time.monotonic()
        self.ready = True

    def blend_read(self) -> None:
        """The followed CacheShard's blend was read (what it publishes is in force, or the flags' if it
        publishes none)."""
        if not self.blend_known:
            log.info("blend in force known: %s r=%g (%s)", self.blend_policy.method, self.blend_policy.ratio,
                     self.blend_policy.reason)
        self.blend_known = True

    def awaiting_blend(self, now: float) -> bool:
        """Whether readiness still waits for the followed CacheShard's blend (at most
        ``blend_wait_seconds`` after the model loaded)."""
        return not self.blend_known and (self.loaded_at is None
                                         or now - self.loaded_at < self.settings.blend_wait_seconds)

    @property
    def vllm_client(self) -> VllmClient | None:
        return self._vllm

    @property
    def identity(self) -> ModelIdentity:
        """The identity blocks are keyed by: the model's, with the prompt template in use."""
        assert self._identity is not None and self._builder is not None, "load() first"
        return dataclasses.replace(self._identity, template=self._builder.template.fingerprint)

    def item_key(self, item_id: str) -> str:
        """The key item ``item_id``'s block is stored under: the prompt shape ``warm_unit`` uses, so the
        keys match a request's exactly (pure: no weights needed). When vLLM computes, the item prefilled
        alone, whatever the blend settings (nothing is blended on that path)."""
        builder = self.builder
        if self._vllm_scorer is not None:
            return self._vllm_scorer.item_key(builder.item_segment(item_id))
        return segment_keys(self.identity, Prompt.of([builder.system_segment, builder.item_segment(item_id)]),
                            self.blend_defaults)[1]

    @property
    def builder(self) -> PromptBuilder:
        assert self._builder is not None, "load() first"
        return self._builder

    def use_catalog(self, catalog: Catalog, version: str, prompt: Mapping[str, str]) -> None:
        """Serve ``catalog`` (version ``version``) under the template ``prompt`` (``spec.prompt``).

        Runs in the worker thread while no request computes (the caller holds the compute slot).
        Block keys are recomputed only for items whose text or fields changed, unless the template
        changed: then every key changes (the template's fingerprint is part of the model identity).
        """
        asked, conflicts = prompt_for_model(prompt, self.trained_prompt)
        if conflicts:
            log.warning("the CacheShard's spec.prompt sets %s other than %s was fine-tuned with (%s): its answers "
                        "may be noise", ", ".join(conflicts), self.model_name,
                        ", ".join(f"{k}={self.trained_prompt[k]}" for k in conflicts))
        template = PromptTemplate.from_spec(asked)
        old_builder, old_keys = self.builder, self.item_block_keys
        items = catalog.items()
        dataset = Dataset(name=f"catalog-{version[:12]}", items=items)
        builder = PromptBuilder(self.tokenizer, dataset, template=template)
        same_template = old_builder.template == template
        self._builder, self._dataset = builder, dataset
        if self._engine is not None:
            self._engine.identity = self.identity
        if self._vllm_scorer is not None:  # a template change changes every key
            self._vllm_scorer.identity = self.identity
        old_items = old_builder.dataset.items
        keys: dict[str, str] = {}
        for item_id, item in items.items():
            prior = old_items.get(item_id) if same_template else None
            if prior is not None and prior.text == item.text and dict(prior.fields) == dict(item.fields) \
                    and item_id in old_keys:
                keys[item_id] = old_keys[item_id]
            else:
                keys[item_id] = self.item_key(item_id)
        self.items, self.users = items, {}
        self.item_block_keys = keys
        self.metrics.catalog_items.labels(self.model_name).set(len(items))
        self.catalog_version, self.prompt_spec = version, dict(prompt)
        if self.holders is not None:
            self.holders.set_item_keys({key: item for item, key in keys.items()})
        log.info("catalog version %s: %d items, template %s", version[:12], len(items),
                 template.fingerprint or "default")

    def _blend_settings(self, policy: BlendPolicy) -> BlendSettings:
        """The engine settings of a blend policy on this sidecar's device (``--selector``, when given,
        replaces the method's selector: the flag of sidecars older than named methods)."""
        base = BlendSettings(device=self.settings.device, dtype=self.settings.dtype,
                             prefill_context=prefill_context_for(self.scorer))
        if self.settings.selector and policy.reason == "Flags":
            return base.with_(selector=self.settings.selector, ratio=policy.ratio)
        return method_settings(policy.method, policy.ratio, base)

    def use_blend(self, policy: BlendPolicy) -> None:
        """Make ``policy`` the blend in force (the followed CacheShard's; event loop, between requests:
        a request parsed before keeps the settings it was parsed with). Settings this model cannot run
        are refused with a log line and the previous ones stay."""
        try:
            settings = self._blend_settings(policy)
            settings.validate(self._engine.executor.shape.num_layers if self._engine is not None else None)
        except ValueError as error:
            log.error("blend %s r=%g not applied: %s", policy.method, policy.ratio, error)
            return
        if not policy.same_settings(self.blend_policy):
            log.info("blend in force: %s r=%g, shadow sample rate %g (%s)", policy.method, policy.ratio,
                     policy.sample_rate, policy.reason)
        self.blend_policy, self.blend_defaults = policy, settings
        self.shadow.sample_rate = policy.sample_rate
        self.shadow.announce(policy.method, policy.ratio)

    def _full_logits(self, prompt: Prompt) -> Any:
        """First-token logits of a full prefill — for a scorer model, the candidates' scores (the shadow
        check's reference; worker thread)."""
        if self.readout is not None:
            return self._engine.full(prompt, readout=self.readout).scores
        return self._engine.full(prompt).logits

    def _offer_shadow(self, built: RecommendationPrompt, call: RecommendCall, result: Any) -> None:
        """Sample a request blended with the settings in force for a shadow check (embedded engine). A
        scorer's check compares the candidates' scores (its KL is over their softmax)."""
        if self._vllm is None and call.blend == self.blend_defaults:
            policy = self.blend_policy
            if result.scores is not None:  # a scorer model
                self.shadow.offer(scoring_prompt(built), tuple(range(len(result.scores))), result.scores,
                                  policy.method, policy.ratio)
                return
            self.shadow.offer(built.prompt, tuple(built.label_token_ids), result.logits, policy.method, policy.ratio)

    def build(self, call: RecommendCall) -> RecommendationPrompt:
        request = RecommendationRequest(call.user_id, call.history, call.candidates)
        builder = self.builder
        inline = {item_id: item for item_id, item in call.inline.items() if item_id not in builder.dataset.items}
        try:
            if call.instruction is None:
                built = builder.build(request, inline)
            else:
                built = PromptBuilder(self.tokenizer, builder.dataset, question="\n" + call.instruction.strip(),
                                      template=builder.template).build(request, inline)
        except KeyError as error:  # an inline item without a field the template's item line uses
            raise RequestError("candidates", f"{error.args[0]}: spec.prompt.itemFormat "
                               f"{builder.template.item_format!r} needs it", status=422) from None
        if inline:
            self.metrics.cold_items.labels(self.model_name).inc(len(inline))
        if len(built.prompt) + call.max_tokens > self.context_tokens:
            raise RequestError("history", f"the prompt has {len(built.prompt)} tokens; with max_tokens it must "
                               f"fit the {self.context_tokens} tokens this sidecar serves", status=413)
        return built

    def recommend(self, call: RecommendCall) -> dict[str, Any]:
        """Blend, rank the candidates or decode (here or in vLLM), and report what was cached where
        (worker thread)."""
        started = time.perf_counter()
        built = self.build(call)
        if call.mode != "rank" and self.readout is not None:
            raise RequestError("mode", f"{self.model_name} ranks the candidates (the {self.scorer} scorer scores "
                               "each one alone) and does not generate: ask \"mode\": \"rank\"", status=422)
        if call.mode == "rank":
            result, scores, ttft_s, extra = self._label_scores(built, call)
            ranking = rank_candidates(built.request.candidates, built.labels, scores)
            answer: dict[str, Any] = {
                "mode": "rank", "label": ranking[0].label, "candidate": ranking[0].candidate,
                "ranking": [ranked.as_json() for ranked in ranking[: call.top_k]]}
        else:
            result, token_ids, text, top, ttft_s, extra = self._generate(built, call)
            label = self.tokenizer.decode(token_ids[:1]).strip()
            answer = {
                "mode": "generate", "text": text, "label": label if label in built.labels else None,
                "candidate": built.candidate_for_label(label),
                "logprobs": [{"token_id": t, "token": self.tokenizer.decode([t]), "logprob": round(v, 6)}
                             for t, v in top.items()]}
        self._record(result, ttft_s)
        self._offer_shadow(built, call, result)
        return {
            **answer,
            "engine": self.settings.engine,
            "model": self.model_name,
            "pod": self.settings.name,
            "blend": {"selector": call.blend.selector, "ratio": call.blend.ratio},
            "timings": {"ttft_ms": round(ttft_s * 1000, 3),
                        "total_ms": round((time.perf_counter() - started) * 1000, 3),
                        "blend_ms": round(result.ttft_s * 1000, 3), **extra,
                        **{f"{k}_ms": round(v * 1000, 3) for k, v in result.timings.items()}},
            "tokens": {"prompt": result.num_tokens, "recomputed": result.recomputed_tokens,
                       "recompute_ratio": round(result.recompute_ratio, 4), "query": result.query_tokens,
                       "hit": result.hit_tokens, "computed": result.computed_tokens},
        }

    def _label_scores(self, built: RecommendationPrompt, call: RecommendCall
                      ) -> tuple[Any, list[float], float, dict[str, float]]:
        """Each candidate's label score at the answer position: the embedded engine's logits, or
        vLLM's full-vocabulary log-probabilities of the label tokens (same order up to a constant) —
        or, for a scorer model, each candidate's score read alone (:meth:`_scores_through_vllm`)."""
        labels = built.label_token_ids
        if self.readout is not None:
            if self._vllm is not None:
                return self._scores_through_vllm(built, call)
            result = self._engine.blend(scoring_prompt(built), call.blend, readout=self.readout)
            return result, result.scores.tolist(), result.ttft_s, {}
        if self._vllm is None:
            result = self._engine.blend(built.prompt, call.blend)
            return result, result.logits[list(labels)].tolist(), result.ttft_s, {}
        vllm = self._vllm
        result, completion, ttft_s, extra = self._through_vllm(
            built, call, lambda tokens: vllm.label_logprobs(tokens, labels))
        return result, [completion.top_logprobs[t] for t in labels], ttft_s, extra

    def _scores_through_vllm(self, built: RecommendationPrompt, call: RecommendCall
                             ) -> tuple[Any, list[float], float, dict[str, float]]:
        """A scorer through vLLM, which does all the math: the item blocks made local (or computed by
        vLLM), then the K candidate prompts in one batch, their item bodies loaded by the connector
        (:mod:`kvshard_sidecar.vllm.scorer`). Exact whatever the blend settings: nothing is blended."""
        assert self._vllm_scorer is not None
        with self._vllm_answers():
            scored = self._vllm_scorer.score(scoring_prompt(built))
        extra = {"vllm_first_token_ms": round(scored.first_token_s * 1000, 3)}
        return scored, scored.scores, scored.ttft_s, extra

    def _generate(self, built: RecommendationPrompt, call: RecommendCall
                  ) -> tuple[Any, list[int], str, dict[int, float], float, dict[str, float]]:
        """Free decoding: the embedded engine decodes on the blended KV, or vLLM does."""
        if self._vllm is None:
            from kvshard_sidecar.engine.results import Sampling

            result, generation = self._engine.generate(
                built.prompt, call.max_tokens, call.blend, Sampling(temperature=call.temperature),
                stop_token_ids=self._eos)
            text = self.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
            return result, generation.token_ids, text, top_logprobs(result.logits, call.logprobs), result.ttft_s, {}
        vllm = self._vllm
        result, completion, ttft_s, extra = self._through_vllm(
            built, call, lambda tokens: vllm.complete(tokens, call.max_tokens, call.temperature, call.logprobs))
        ranked = sorted(completion.top_logprobs.items(), key=lambda pair: -pair[1])
        return result, completion.token_ids, completion.text, dict(ranked[: call.logprobs]), ttft_s, extra

    def _through_vllm(self, built: RecommendationPrompt, call: RecommendCall,
                      ask: Callable[[Sequence[int]], Completion]) -> tuple[Any, Completion, float, dict[str, float]]:
        """Blend here, hand the prompt KV to vLLM through the exchange, and ask vLLM (``ask``)."""
        assert self._exchange is not None
        result = self._engine.blend(built.prompt, call.blend)
        tokens = built.prompt.token_ids
        n = result.num_tokens
        started = time.perf_counter()
        self._exchange.write(tokens, result.kv.keys[:, :, :n], result.kv.values[:, :, :n])
        exchange_s = time.perf_counter() - started
        try:
            with self._vllm_answers():
                completion = ask(tokens)
        finally:
            self._exchange.remove(tokens)  # the connector removes it after loading; this covers failures
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
            raise RequestError("engine", f"vLLM at {self.settings.vllm_url} did not answer: {error}",
                               status=503) from None

    def _record(self, result: Any, ttft_s: float) -> None:
        metrics, name = self.metrics, self.model_name
        metrics.ttft.labels(name).observe(ttft_s)
        metrics.pressure.observe_ttft(ttft_s)
        metrics.recompute_ratio.labels(name).observe(result.recompute_ratio)
        for kind, count in result.query_tokens.items():
            metrics.query_tokens.labels(name, kind).inc(count)
        for kind, tiers in result.hit_tokens.items():
            for tier, count in tiers.items():
                metrics.hit_tokens.labels(name, kind, tier).inc(count)

    def warm_unit(self, unit: WarmUnit) -> int:
        """Make sure the blocks of some items or of one user's history are stored (worker thread);
        returns tokens computed. Items go through one batched prefill: their keys are the same as
        one by one (a key depends on the segment and its context, never the position)."""
        builder = self.builder
        if self._vllm_scorer is not None:
            return self._warm_through_vllm(unit)
        segments = [builder.system_segment]
        if unit.kind == "item":
            segments += [builder.item_segment(ident) for ident in unit.idents]
        else:
            segments += [builder.history_segment(self.users[ident][-self.settings.max_history:])
                         for ident in unit.idents]
        computed: dict[str, int] = self._engine.ensure_blocks(Prompt.of(segments))
        return sum(computed.values())

    def _warm_through_vllm(self, unit: WarmUnit) -> int:
        """Warming when vLLM computes: item bodies a late scorer loads are prefilled alone by vLLM and saved
        by its connector; an isolated scorer's items read the history, so nothing of theirs is stored
        ahead, and history prefixes are stored on a user's first request (vLLM computes them then)."""
        assert self._vllm_scorer is not None
        if unit.kind != "item":
            return 0
        segments = [self.builder.item_segment(ident) for ident in unit.idents]
        wanted = {self.item_key(ident): list(segment.token_ids) for ident, segment in zip(unit.idents, segments,
                                                                                         strict=True)
                  if self._vllm_scorer.body_tokens(len(segment)) > 0}
        computed = self._vllm_scorer.ensure(wanted)
        return sum(len(wanted[key]) for key in computed)

    def _item_keys(self) -> dict[str, str]:
        """Item id → the key its block is stored under (1,682 MovieLens items: a few milliseconds)."""
        return {item: self.item_key(item) for item in self.items}

    def history_users(self, count: int) -> list[str]:
        """The ``count`` most active users (longest histories first, then by id) to warm ahead."""
        ranked = sorted(self.users, key=lambda user: (-len(self.users[user]), user))
        return ranked[:count]

    def evict_blocks(self, keys: Iterable[str]) -> int:
        """Drop blocks from memory and disk (blocking: disk I/O); returns how many were held."""
        return sum(self.store.evict(key) for key in keys)

    def stored(self, keys: Iterable[str]) -> bool:
        """Whether every key is held by a local tier (memory or disk)."""
        return all(self.store.contains(key) is not None for key in keys)

    def block_for_peer(self, key: str) -> Path | bytes | None:
        """A stored block for a peer: the verified file (sent with sendfile), else encoded bytes.

        A disk file is checked before it is offered, so a corrupt one is counted, removed and never
        sent; a memory-only block is encoded (with its checksum) on the fly.
        """
        if self.store.disk is not None:
            path = self.store.disk.verified_path(key)
            if path is not None:
                return path
        block = self.store.memory.get(key)
        return encode_block(key, block) if block is not None else None

    def close(self) -> None:
        if self._vllm_scorer is not None:
            self._vllm_scorer.close()
        self.store.close()


def top_logprobs(logits: Any, count: int) -> dict[int, float]:
    """The ``count`` most likely first tokens with their log-probabilities (most likely first)."""
    if count <= 0:
        return {}
    import torch

    values, indices = torch.topk(torch.log_softmax(logits.float(), dim=-1), count)
    return {int(i): float(v) for i, v in zip(indices.tolist(), values.tolist(), strict=True)}
