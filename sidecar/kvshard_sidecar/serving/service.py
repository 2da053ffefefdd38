"""What one sidecar does, without HTTP: one façade over the collaborators that load, switch, answer and warm.

The HTTP layer (:mod:`kvshard_sidecar.api.app`) validates and admits; the followers
(:mod:`kvshard_sidecar.follow`) switch catalogs and blends; both talk to :class:`SidecarService`, which
only composes the pod's parts and hands each call to the one that does it:

* :class:`~.model_host.ModelHost` — the model, and the blend engine or vLLM that computes with it;
* :class:`~.catalog_state.CatalogState` — the catalog, the prompt template and every item's block key;
* :class:`~.blend_state.BlendInForce` — the blend settings in force and the shadow checks' sample rate;
* :class:`~.answer.Answerer` — a recommendation call from prompt to JSON answer (:mod:`.compute`: the numbers);
* :class:`~.warming.BlockWarmer` — blocks warmed between requests, evicted, and sent to peers.

Model work is called from one worker thread at a time, so the engine needs no locks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from kvshard.blend_policy import BlendPolicy
from kvshard.catalog_schema import Catalog
from kvshard.datasets import Item
from kvshard.prompt_template import PromptTemplate
from kvshard_sidecar.blockstore import BlockStore
from kvshard_sidecar.blockstore.peers import HoldersOf, PeerFetcher, PlacementHolders, static_holders
from kvshard_sidecar.engine.settings import BlendSettings
from kvshard_sidecar.metrics import SidecarMetrics
from kvshard_sidecar.pressure import PressureTracker
from kvshard_sidecar.serving.answer import Answerer, RecommendAnswer
from kvshard_sidecar.serving.blend_state import BlendInForce
from kvshard_sidecar.serving.calls import Limits, RecommendCall
from kvshard_sidecar.serving.catalog_state import CatalogState
from kvshard_sidecar.serving.model_host import ModelHost
from kvshard_sidecar.serving.prefill_queue import PrefillQueue, WarmUnit
from kvshard_sidecar.serving.shadow import ShadowChecker
from kvshard_sidecar.serving.warming import BlockWarmer
from kvshard_sidecar.settings import SidecarSettings
from kvshard_sidecar.vllm.client import VllmClient


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
        self.host = ModelHost(settings, self.store)
        self.concurrency = settings.vllm_concurrency if self.host.vllm_computes else settings.max_concurrency
        self.metrics = SidecarMetrics(self.host.name, self.store.stats, cacheshard=settings.cacheshard,
                                      pressure=PressureTracker(self.concurrency, settings.ttft_target_seconds,
                                                               settings.pressure_window_seconds))
        self.prefill_queue = PrefillQueue(self)
        self.ready = False
        self.load_error = ""
        self.loaded_at: float | None = None
        """``time.monotonic()`` when the model finished loading."""
        self.shadow = ShadowChecker(self.metrics, self.host.full_logits,
                                    budget_share=settings.shadow_budget_percent / 100)
        self.blend = BlendInForce(settings, self.host.scorer, self.shadow)
        self.catalog = CatalogState(settings, self.host, self.blend, self.metrics, self.holders)
        self.answers = Answerer(settings, self.host, self.catalog, self.blend, self.metrics, self.shadow)
        self.warming = BlockWarmer(self.store, self.host, self.catalog, settings.max_history)

    # ------------------------------------------------------------------ what the collaborators hold

    @property
    def model_name(self) -> str:
        return self.host.name

    @property
    def vllm_computes(self) -> bool:
        return self.host.vllm_computes

    @property
    def vllm_client(self) -> VllmClient | None:
        return self.host.vllm

    @property
    def items(self) -> Mapping[str, Item]:
        return self.catalog.items

    @property
    def users(self) -> Mapping[str, list[str]]:
        return self.catalog.users

    @property
    def item_block_keys(self) -> Mapping[str, str]:
        return self.catalog.item_block_keys

    @property
    def catalog_version(self) -> str:
        """The catalog version in use ("" = ``--dataset``)."""
        return self.catalog.version

    @property
    def prompt_spec(self) -> Mapping[str, str]:
        """``spec.prompt`` in use ({} = the default template)."""
        return self.catalog.prompt_spec

    @property
    def blend_policy(self) -> BlendPolicy:
        return self.blend.policy

    @property
    def blend_defaults(self) -> BlendSettings:
        return self.blend.defaults

    @property
    def blend_known(self) -> bool:
        return self.blend.known

    # ------------------------------------------------------------------ calls

    def load(self) -> None:
        """Load catalog and model (seconds); the API answers 503 until this returns."""
        dataset = self.catalog.read_dataset()
        template = PromptTemplate.from_spec(self.host.trained_prompt)
        self.host.load(template.fingerprint, self.blend.defaults)
        self.metrics.model_name = self.host.name
        self.catalog.start(dataset, template)
        self.limits = Limits(min(self.settings.max_candidates, self.catalog.builder.max_candidates),
                             self.settings.max_history, self.settings.max_new_tokens, num_layers=self.host.num_layers)
        self.metrics.ready.labels(self.host.name).set(1)
        self.loaded_at = time.monotonic()
        self.ready = True

    def blend_read(self) -> None:
        """The followed CacheShard's blend was read (:meth:`BlendInForce.read`)."""
        self.blend.read()

    def awaiting_blend(self, now: float) -> bool:
        """Whether readiness still waits for the followed CacheShard's blend (at most
        ``blend_wait_seconds`` after the model loaded)."""
        return self.blend.awaited(now, self.loaded_at)

    def use_blend(self, policy: BlendPolicy) -> None:
        """Make ``policy`` the blend in force (the followed CacheShard's; event loop, between requests:
        a request parsed before keeps the settings it was parsed with). Settings this model cannot run
        are refused with a log line and the previous ones stay."""
        self.blend.use(policy, self.host.engine_layers)

    def use_catalog(self, catalog: Catalog, version: str, prompt: Mapping[str, str]) -> None:
        """Serve ``catalog`` (version ``version``) under the template ``prompt`` (:meth:`CatalogState.use`;
        worker thread, while no request computes)."""
        self.catalog.use(catalog, version, prompt)

    def recommend(self, call: RecommendCall) -> RecommendAnswer:
        """Blend, rank the candidates or decode (here or in vLLM), and report what was cached where
        (worker thread)."""
        return self.answers.recommend(call)

    def warm_unit(self, unit: WarmUnit) -> int:
        """Make sure a unit's blocks are stored (worker thread); returns tokens computed."""
        return self.warming.warm_unit(unit)

    def history_users(self, count: int) -> list[str]:
        """The ``count`` most active users (longest histories first, then by id) to warm ahead."""
        return self.warming.history_users(count)

    def evict_blocks(self, keys: Iterable[str]) -> int:
        """Drop blocks from memory and disk (blocking: disk I/O); returns how many were held."""
        return self.warming.evict(keys)

    def stored(self, keys: Iterable[str]) -> bool:
        """Whether every key is held by a local tier (memory or disk)."""
        return self.warming.stored(keys)

    def block_for_peer(self, key: str) -> Path | bytes | None:
        """A stored block for a peer: the verified file, else encoded bytes (:meth:`BlockWarmer.block_for_peer`)."""
        return self.warming.block_for_peer(key)

    def close(self) -> None:
        self.host.close()
        self.store.close()
