"""The model a sidecar hosts, and whatever computes with it: the blend engine, or vLLM.

Why a module of its own: which of the three ways a pod computes — the embedded engine alone, the engine
blending and vLLM decoding (an answer-position model with ``--engine vllm``), or vLLM doing all the math
(a scorer model with ``--engine vllm``: this process holds the tokenizer, never the weights) — is decided
once, from the model folder and the flags, and every other collaborator only asks this host what is
there. It also owns the identity blocks are keyed by: the model's, with the prompt template in use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvshard.models import model_prompt, model_retrieval_weight, model_scorer, resolve_model
from kvshard.prompts import PromptBuilder, TextTokenizer
from kvshard.segments import ModelIdentity, Prompt
from kvshard_sidecar.blockstore import BlockStore
from kvshard_sidecar.engine.contexts import segment_keys
from kvshard_sidecar.engine.isolated_scorer import Readout
from kvshard_sidecar.engine.settings import BlendSettings
from kvshard_sidecar.settings import SidecarSettings
from kvshard_sidecar.vllm.client import VllmClient
from kvshard_sidecar.vllm.exchange import KVExchange
from kvshard_sidecar.vllm.scorer import VllmScorer

if TYPE_CHECKING:
    import torch

    from kvshard_sidecar.engine.blend import BlendEngine


class Tokenizer(TextTokenizer, Protocol):
    """The slice of a Hugging Face tokenizer the sidecar uses: the prompt builder's, decoding, end of text."""

    eos_token_id: int | list[int] | None

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class ModelConfig(Protocol):
    """The slice of a Hugging Face model config the sidecar reads (``max_position_embeddings`` when present)."""

    num_hidden_layers: int


class ModelHost:
    """Loads the model once (worker thread) and holds what answers with it; built before, usable after ``load``."""

    def __init__(self, settings: SidecarSettings, store: BlockStore) -> None:
        self.settings = settings
        self.store = store
        self.path = resolve_model(settings.model)
        self.name = self.path.name
        """The model's name: the folder's until ``load``, then the identity's."""
        # a fine-tuned model is asked as it was trained (its label position) unless a CacheShard says otherwise
        self.trained_prompt = model_prompt(self.path)
        self.scorer = model_scorer(self.path)
        """How the model ranks (:data:`kvshard.models.SCORERS`): at the answer position, or each candidate
        scored alone (:mod:`kvshard_sidecar.engine.isolated_scorer`, embedded engine only)."""
        self.retrieval_weight = model_retrieval_weight(self.path)
        """The retrieval stage's weight in a fused ranking when a request names none (the model's own)."""
        self.vllm_computes = settings.engine == "vllm" and self.scorer != "answer"
        """A scorer served with ``--engine vllm``: vLLM does all the math (:mod:`kvshard_sidecar.vllm.scorer`),
        this process holds the tokenizer, never the weights, and admits ``vllm_concurrency`` requests."""
        self.readout: Readout | None = None
        self.engine: BlendEngine | None = None
        self.vllm: VllmClient | None = None
        self.exchange: KVExchange | None = None
        """Where blended prompt KV is handed to vLLM: only when the engine blends and vLLM decodes."""
        self.vllm_scorer: VllmScorer | None = None
        self.eos: set[int] = set()
        self.num_layers = 0
        self.context_tokens = 0
        """The most prompt plus new tokens a request may take (the model's context, or ``--max-prompt-tokens``)."""
        self._tokenizer: Tokenizer | None = None
        self._identity: ModelIdentity | None = None
        self._template = ""
        if settings.engine == "vllm":
            self.vllm = VllmClient(settings.vllm_url, settings.vllm_model or self.name)
            if not self.vllm_computes:
                self.exchange = KVExchange(settings.exchange_dir)

    def load(self, template: str, blend: BlendSettings) -> None:
        """Load the tokenizer (and, unless vLLM computes, the weights and the engine, blending with ``blend``
        by default); blocks are keyed with the prompt template fingerprint ``template``."""
        from kvshard_sidecar.engine.blend import BlendEngine
        from kvshard_sidecar.engine.model import load_model, load_tokenizer

        settings = self.settings
        config: ModelConfig
        if self.vllm_computes:
            tokenizer, config, identity = load_tokenizer(self.path, settings.dtype)
        else:
            loaded = load_model(self.path, dtype=settings.dtype, device=settings.device)
            tokenizer, config, identity = loaded.tokenizer, loaded.config, loaded.identity
        self.name = identity.name
        self._identity, self._template = identity, template
        self.readout = Readout.for_model(tokenizer, self.path)
        if self.vllm_computes:
            assert self.vllm is not None and self.readout is not None
            self.vllm_scorer = VllmScorer(self.vllm, self.store, self.identity, self.readout.token,
                                          self.readout.interaction)
        else:
            self.engine = BlendEngine(loaded.model, self.identity, self.store, blend)
        eos = tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        self.num_layers = int(config.num_hidden_layers)
        context = int(getattr(config, "max_position_embeddings", 2048))
        self.context_tokens = min(context, settings.max_prompt_tokens or context)
        self._tokenizer = tokenizer

    @property
    def tokenizer(self) -> Tokenizer:
        assert self._tokenizer is not None, "load() first"
        return self._tokenizer

    @property
    def identity(self) -> ModelIdentity:
        """The identity blocks are keyed by: the model's, with the prompt template in use."""
        assert self._identity is not None, "load() first"
        return dataclasses.replace(self._identity, template=self._template)

    def use_template(self, template: str) -> None:
        """Key blocks with the template fingerprint ``template`` from now on (a catalog switch: while no
        request computes)."""
        self._template = template
        if self.engine is not None:
            self.engine.identity = self.identity
        if self.vllm_scorer is not None:  # a template change changes every key
            self.vllm_scorer.identity = self.identity

    @property
    def engine_layers(self) -> int | None:
        """The embedded engine's layer count (what blend settings are validated against); None without one."""
        return self.engine.executor.shape.num_layers if self.engine is not None else None

    def item_key(self, builder: PromptBuilder, item_id: str, blend: BlendSettings) -> str:
        """The key item ``item_id``'s block is stored under: the prompt shape warming uses, so the keys
        match a request's exactly (pure: no weights needed). When vLLM computes, the item prefilled
        alone, whatever the blend settings (nothing is blended on that path)."""
        if self.vllm_scorer is not None:
            return self.vllm_scorer.item_key(builder.item_segment(item_id))
        return segment_keys(self.identity, Prompt.of([builder.system_segment, builder.item_segment(item_id)]),
                            blend)[1]

    def full_logits(self, prompt: Prompt) -> torch.Tensor:
        """First-token logits of a full prefill — for a scorer model, the candidates' scores (the shadow
        check's reference; worker thread)."""
        assert self.engine is not None, "a shadow check needs the embedded engine"
        if self.readout is not None:
            scores = self.engine.full(prompt, readout=self.readout).scores
            assert scores is not None
            return scores
        return self.engine.full(prompt).logits

    def close(self) -> None:
        if self.vllm_scorer is not None:
            self.vllm_scorer.close()
