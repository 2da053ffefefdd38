"""What the engine hands back: one prefill's result, and decoding's policy and output.

Kept apart from the engine so callers (the sidecar, the benchmarks, tests) can name these types
without reading the layer loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvshard_sidecar.engine.kvbuffer import KVBuffer


@dataclass
class BlendResult:
    """What one prefill produced.

    Attributes:
        method: ``full``, ``prefix`` or the selector name.
        logits: float32 ``[vocab]`` of the first generated token.
        ttft_s: wall time from request to logits (fetch + compute + assemble + layers + head).
        timings: seconds per step: ``fetch``, ``compute`` (cold blocks), ``assemble``, ``layers``, ``head``.
        num_tokens: prompt length N.
        exact_prefix_tokens: leading tokens served exactly from cache, never recomputed.
        recomputed_tokens: tokens that ran through the last layer.
        token_layers: Σ over layers of tokens whose K/V were computed there (the cost model's unit).
        query_tokens: prompt tokens per segment kind.
        hit_tokens: tokens served from a tier, per kind then tier (``memory``, ``disk``, ``peer``…).
        computed_tokens: tokens of blocks computed on the cold path, per kind.
        selected: positions recomputed at the last layer.
        kv: the prompt's KV after prefill (what decoding continues on).
        scores: for the isolated scorer's prompt (``readout`` given), each candidate's float32
            ``log P(readout)`` at its label opening ``[K]``; ``None`` otherwise.
    """

    method: str
    logits: torch.Tensor
    ttft_s: float
    timings: dict[str, float]
    num_tokens: int
    exact_prefix_tokens: int
    recomputed_tokens: int
    token_layers: int
    num_layers: int
    query_tokens: dict[str, int]
    hit_tokens: dict[str, dict[str, int]]
    computed_tokens: dict[str, int]
    selected: torch.Tensor
    kv: KVBuffer = field(repr=False)
    scores: torch.Tensor | None = None

    @property
    def recompute_ratio(self) -> float:
        """Share of the prompt that ran through the last layer."""
        return self.recomputed_tokens / max(1, self.num_tokens)

    @property
    def full_token_layers(self) -> int:
        return self.num_tokens * self.num_layers

    @property
    def ideal_speedup(self) -> float:
        """Full prefill's token-layers over this prefill's: the speedup if cost were linear in them."""
        return self.full_token_layers / max(1, self.token_layers)

    @property
    def cold(self) -> bool:
        return bool(self.computed_tokens)


@dataclass(frozen=True)
class Sampling:
    """Decoding policy: greedy when ``temperature == 0``; else softmax sampling, optionally top-k."""

    temperature: float = 0.0
    top_k: int | None = None
    seed: int | None = None


@dataclass
class Generation:
    """Decoded token ids (the first comes from the prefill's logits) and, if kept, each step's logits."""

    token_ids: list[int]
    logits: list[torch.Tensor]
    stopped: bool


def pick_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    if sampling.temperature <= 0:
        return int(torch.argmax(logits))
    scaled = logits.float() / sampling.temperature
    if sampling.top_k:
        top = torch.topk(scaled, min(sampling.top_k, scaled.numel()))
        choice = torch.multinomial(torch.softmax(top.values, -1), 1, generator=generator)
        return int(top.indices[choice])
    return int(torch.multinomial(torch.softmax(scaled, -1), 1, generator=generator))
