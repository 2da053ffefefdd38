"""Decoding after a prefill: one token at a time on the prefill's KV buffer.

Why apart from the blend: decoding does not care how the prompt's KV was made — full prefill, a
prefix cache or a blend all hand over a :class:`~kvshard_sidecar.engine.results.BlendResult` whose
rows are the prompt's — so it needs only the model's executor, and every way of prefilling shares it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvshard_sidecar.engine.executor import Executor
from kvshard_sidecar.engine.results import BlendResult, Generation, Sampling, pick_token


@torch.inference_mode()
def decode(
    executor: Executor,
    result: BlendResult,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    stop_token_ids: Iterable[int] = (),
    keep_logits: bool = False,
) -> Generation:
    """Continue from a prefill: the first token comes from ``result.logits``, the rest are decoded on
    ``result.kv`` (rows after the prompt are overwritten, so a result can be decoded again)."""
    sampling = sampling or Sampling()
    stops = set(stop_token_ids)
    generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    kv = result.kv
    kv.reserve(result.num_tokens + max_new_tokens)
    logits = result.logits
    tokens: list[int] = []
    kept: list[torch.Tensor] = []
    position = result.num_tokens
    for step in range(max_new_tokens):
        if keep_logits:
            kept.append(logits)
        token = pick_token(logits, sampling, generator)
        tokens.append(token)
        if token in stops:
            return Generation(tokens, kept, True)
        if step == max_new_tokens - 1:
            break
        at = torch.tensor([position], device=executor.device)
        hidden = executor.embed(torch.tensor([token], device=executor.device))
        rope = executor.rope(at)
        for layer in range(executor.shape.num_layers):
            q, k, v = executor.project(layer, hidden, rope)
            kv.write(layer, at, k, v)
            keys, values = kv.layer(layer, upto=position + 1)
            hidden = executor.finish(layer, hidden, q, keys, values, None)
        logits = executor.logits(hidden)[0].cpu()
        position += 1
    return Generation(tokens, kept, False)
