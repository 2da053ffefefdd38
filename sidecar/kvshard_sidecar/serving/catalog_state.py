"""The catalog a sidecar serves, the prompt template it asks in, and the block key of every item.

Why a module of its own: the catalog and the template come from the followed CacheShard — the placement
generation names a catalog version and carries ``spec.prompt`` — and switching to them changes the prompt
builder, the model identity blocks are keyed by and every changed item's key at once, while no request
computes. ``--dataset`` is the catalog of a sidecar that follows nothing, and of one whose generations
name no catalog (written by an operator older than catalog versions). Items a request brings inline
(``{"id", "text"}``) and the catalog lacks are *cold items*: :mod:`.answer` builds their segments.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvshard.catalog_schema import Catalog
from kvshard.datasets import Dataset, DatasetError, Item, load_dataset
from kvshard.models import prompt_for_model
from kvshard.prompt_template import PromptTemplate
from kvshard.prompts import PromptBuilder
from kvshard_sidecar.blockstore.peers import PlacementHolders
from kvshard_sidecar.metrics import SidecarMetrics
from kvshard_sidecar.serving.blend_state import BlendInForce
from kvshard_sidecar.serving.model_host import ModelHost
from kvshard_sidecar.settings import SidecarSettings

log = logging.getLogger(__name__)


class CatalogState:
    """Items, histories, the prompt builder and item block keys in use; switched by :meth:`use`."""

    def __init__(self, settings: SidecarSettings, host: ModelHost, blend: BlendInForce, metrics: SidecarMetrics,
                 holders: PlacementHolders | None) -> None:
        self.settings = settings
        self.host = host
        self.blend = blend
        self.metrics = metrics
        self.holders = holders
        self.items: Mapping[str, Item] = {}
        self.users: Mapping[str, list[str]] = {}
        self.item_block_keys: Mapping[str, str] = {}
        self.version = ""
        """The catalog version in use ("" = ``--dataset``)."""
        self.prompt_spec: Mapping[str, str] = {}
        """``spec.prompt`` in use ({} = the default template)."""
        self._builder: PromptBuilder | None = None

    def read_dataset(self) -> Dataset:
        """``--dataset`` (before the model loads); following a CacheShard, an unreadable one is an empty
        catalog until the first generation brings the CacheShard's."""
        try:
            dataset = load_dataset(self.settings.dataset)
        except DatasetError as error:
            if not self.settings.etcd_endpoints:
                raise
            log.warning("--dataset %s not loaded (%s); waiting for the CacheShard's catalog", self.settings.dataset,
                        error)
            dataset = Dataset(name="empty", items={})
        self.items, self.users = dataset.items, dataset.histories
        return dataset

    def start(self, dataset: Dataset, template: PromptTemplate) -> None:
        """Serve ``dataset`` under ``template`` once the model loaded: the builder and every item's key."""
        self._builder = PromptBuilder(self.host.tokenizer, dataset, template=template)
        self.item_block_keys = {item: self.item_key(item) for item in self.items}
        self.metrics.catalog_items.labels(self.host.name).set(len(self.items))
        if self.holders is not None:
            self.holders.set_item_keys({key: item for item, key in self.item_block_keys.items()})

    @property
    def builder(self) -> PromptBuilder:
        assert self._builder is not None, "load() first"
        return self._builder

    def item_key(self, item_id: str) -> str:
        """The key item ``item_id``'s block is stored under (:meth:`ModelHost.item_key`, blended as in force)."""
        return self.host.item_key(self.builder, item_id, self.blend.defaults)

    def use(self, catalog: Catalog, version: str, prompt: Mapping[str, str]) -> None:
        """Serve ``catalog`` (version ``version``) under the template ``prompt`` (``spec.prompt``).

        Runs in the worker thread while no request computes (the caller holds the compute slot).
        Block keys are recomputed only for items whose text or fields changed, unless the template
        changed: then every key changes (the template's fingerprint is part of the model identity).
        """
        trained = self.host.trained_prompt
        asked, conflicts = prompt_for_model(prompt, trained)
        if conflicts:
            log.warning("the CacheShard's spec.prompt sets %s other than %s was fine-tuned with (%s): its answers "
                        "may be noise", ", ".join(conflicts), self.host.name,
                        ", ".join(f"{k}={trained[k]}" for k in conflicts))
        template = PromptTemplate.from_spec(asked)
        old_builder, old_keys = self.builder, self.item_block_keys
        items = catalog.items()
        dataset = Dataset(name=f"catalog-{version[:12]}", items=items)
        builder = PromptBuilder(self.host.tokenizer, dataset, template=template)
        same_template = old_builder.template == template
        self._builder = builder
        self.host.use_template(template.fingerprint)
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
        self.metrics.catalog_items.labels(self.host.name).set(len(items))
        self.version, self.prompt_spec = version, dict(prompt)
        if self.holders is not None:
            self.holders.set_item_keys({key: item for item, key in keys.items()})
        log.info("catalog version %s: %d items, template %s", version[:12], len(items),
                 template.fingerprint or "default")
