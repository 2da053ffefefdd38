"""Tiny random Llama-family models and prompts for the blend tests (no weights needed)."""

from __future__ import annotations

from typing import Any

import torch

from kvshard.segments import ModelIdentity, Prompt, Segment, SegmentKind


def tiny_model(kind: str = "llama", rope: dict[str, Any] | None = None, seed: int = 0) -> Any:
    """A 3-layer random model of the given family, float32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
    )
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(head_dim=16, **common))
    return model.eval()


TINY_IDENTITY = ModelIdentity("tiny", "random", "none")


def tiny_prompt(seed: int = 1, sizes: tuple[int, ...] = (6, 9, 2, 5, 2, 7, 4)) -> Prompt:
    """A prompt shaped like a recommendation prompt: system, history, free/item pairs, instruction."""
    generator = torch.Generator().manual_seed(seed)
    kinds = [SegmentKind.SYSTEM, SegmentKind.HISTORY]
    kinds += [SegmentKind.FREE if i % 2 == 0 else SegmentKind.ITEM for i in range(len(sizes) - 3)]
    kinds.append(SegmentKind.INSTRUCTION)
    segments = []
    for kind, size in zip(kinds, sizes, strict=True):
        ids = torch.randint(3, 97, (size,), generator=generator).tolist()
        segments.append(Segment(kind, tuple(ids)))
    return Prompt.of(segments)
