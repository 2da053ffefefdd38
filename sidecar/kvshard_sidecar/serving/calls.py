"""What the serving room is asked: validated requests as typed values, and the limits they were checked against.

:mod:`kvshard_sidecar.api.validation` builds these from JSON; everything below the API takes them, so
no request path ever sees an unchecked dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvshard.datasets import Item
from kvshard_sidecar.engine.settings import BlendSettings


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (from the sidecar settings)."""

    max_candidates: int = 80
    max_history: int = 200
    max_new_tokens: int = 32
    num_layers: int | None = None  # the loaded model's, so a check layer beyond it is the client's mistake


@dataclass(frozen=True)
class RecommendCall:
    """A validated ``POST /v1/recommend``.

    ``mode="rank"`` (the default) answers with every candidate ranked by its label token's
    log-probability at the answer position, ``top_k`` of them; ``mode="generate"`` decodes
    ``max_tokens`` freely (``temperature``, ``logprobs`` of the first token) as a chat model would.
    """

    user_id: str
    history: tuple[str, ...]
    candidates: tuple[str, ...]
    instruction: str | None = None
    mode: str = "rank"
    top_k: int | None = None  # rank mode: how many ranked candidates to return (None: all)
    max_tokens: int = 1
    temperature: float = 0.0
    blend: BlendSettings = field(default_factory=BlendSettings)
    logprobs: int = 0  # how many top first-token logprobs to return
    inline: Mapping[str, Item] = field(default_factory=dict)
    """Items given as ``{"id", "text", ...}`` that the catalog lacks (cold items), by id."""
    retrieval_scores: tuple[float, ...] | None = None
    """Rank mode: the retrieval stage's score of each candidate; the ranking fuses them with the model's
    (:func:`kvshard.ranking.fuse_scores`)."""
    retrieval_weight: float | None = None
    """The stage's weight in the fused ranking; ``None``: the served model's own
    (:func:`kvshard.models.model_retrieval_weight`, chosen on validation when it was trained)."""


@dataclass(frozen=True)
class PrefillCall:
    """A validated ``POST /v1/blocks/prefill``: items and/or users to warm."""

    items: tuple[str, ...]
    users: tuple[str, ...]
