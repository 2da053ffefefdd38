"""Whether ``KvshardConnector`` may run beside vLLM's automatic prefix cache: a pure decision.

Why it exists. With the prefix cache on, every block the connector fills is cached under the prompt's
token hashes and reused as an exact prefix hit by any later request sharing those tokens — from any
client of the server. That is wanted when everything the connector injects is exact for the model,
and silently wrong when it is an approximate blend. Which of the two holds follows from the model
the server runs:

* a **block-trained scorer** (``late``, ``isolated``: :data:`kvshard.models.SCORERS`) is served on the
  plan path only (:mod:`kvshard_sidecar.vllm.plan`): the connector injects rows vLLM itself computed
  (a saved prefix) and, for ``late``, item bodies prefilled alone — exactly what the model reads there,
  whatever blend method the CacheShard names (blend methods steer the sidecar's own engine). The
  prefix cache is then safe, and wanted: it computes each recommendation's prefix once;
* any other model may receive sidecar-blended KV through the exchange, exact only when every blend
  recomputes everything: the prefix cache is refused unless ``"allow_prefix_caching": true`` says so.

No vLLM import, so the decision is unit-tested without a server.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ALLOW_PREFIX_CACHING = "allow_prefix_caching"  # the kv_connector_extra_config key of the override
EXACT_SCORERS = ("late", "isolated")
"""Scorers whose connector loads are exact by construction (see the module docstring)."""

PREFIX_CACHING_REFUSED = (
    "KvshardConnector refuses to start: vLLM's automatic prefix caching is on (vLLM's default; "
    "--enable-prefix-caching also turns it on). vLLM would cache the blocks this connector fills from "
    "blended KV, which is approximate unless the blend recomputed every token, under the prompt's "
    "token hashes, and any later request sharing that token prefix, from any client of this server, "
    "would reuse them as an exact prefix hit. Fix: start vLLM with --no-enable-prefix-caching "
    "(kvshard's sidecar reuses the exact system and history prefixes itself, so kvshard requests lose "
    "nothing). Only if every blend recomputes all tokens (blend ratio 1) may prefix caching stay on: "
    f'then set "{ALLOW_PREFIX_CACHING}": true in the kv_connector_extra_config of --kv-transfer-config. '
    f"A block-trained scorer model ({', '.join(EXACT_SCORERS)}) needs neither: everything loaded for it "
    "is exact, and the prefix cache is allowed."
)

PREFIX_CACHING_ALLOWED = (
    f'vLLM\'s prefix caching is on and "{ALLOW_PREFIX_CACHING}": true lets KvshardConnector run beside '
    "it: blocks filled from blended KV will be reused as exact prefix hits by later requests sharing "
    "their token prefix. Only safe when every blend recomputes all tokens (blend ratio 1); otherwise "
    "start vLLM with --no-enable-prefix-caching."
)


def prefix_caching_exact(scorer: str) -> str:
    """The start-up line of a server whose loads are exact (``scorer`` ∈ :data:`EXACT_SCORERS`)."""
    return (f"vLLM's prefix cache is allowed: this model is a block-trained {scorer} scorer, served on the "
            "plan path only (prefix rows vLLM computed itself" + (", item bodies prefilled alone" if scorer == "late"
                                                                   else "") +
            "), so every block the connector fills is exact and the prefix cache computes each prefix once")


class PrefixCachingError(ValueError):
    """The connector cannot run beside vLLM's prefix cache as configured; raised at startup so the
    vLLM server exits with the reason instead of serving approximate KV as exact prefix hits."""


def check_prefix_caching(enable_prefix_caching: bool, extra_config: Mapping[str, Any],
                         scorer: str = "answer") -> str | None:
    """Whether the connector may run with vLLM's ``cache_config.enable_prefix_caching`` for a model
    trained as ``scorer``.

    Returns ``None`` when the prefix cache is off; the line to log when it is on and allowed (an exact
    scorer: :func:`prefix_caching_exact`; the override: :data:`PREFIX_CACHING_ALLOWED`); raises
    :class:`PrefixCachingError` when it is on for a model that may receive blended KV without the
    override. The override must be a JSON boolean: a string such as ``"false"`` would be truthy, so a
    mistyped value is refused rather than guessed at.
    """
    allowed = extra_config.get(ALLOW_PREFIX_CACHING, False)
    if not isinstance(allowed, bool):
        raise PrefixCachingError(
            f'kv_connector_extra_config "{ALLOW_PREFIX_CACHING}" must be a JSON boolean (true or false), '
            f"got {allowed!r}")
    if not enable_prefix_caching:
        return None
    if scorer in EXACT_SCORERS:
        return prefix_caching_exact(scorer)
    if not allowed:
        raise PrefixCachingError(PREFIX_CACHING_REFUSED)
    return PREFIX_CACHING_ALLOWED
