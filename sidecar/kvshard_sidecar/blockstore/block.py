"""The unit every tier stores: one segment's KV for every layer.

Keys are stored exactly as a standalone prefill of the segment produces them, i.e. rotated for
positions ``0 .. tokens-1``; the blend engine re-rotates them by the segment's offset in the prompt
(RoPE is a rotation, so R(p + δ) = R(δ)·R(p)). Values carry no position and are stored as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVBlock:
    """Per-layer K and V of one segment, stacked: ``[layers, kv_heads, tokens, head_dim]``."""

    keys: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        if self.keys.shape != self.values.shape or self.keys.dim() != 4:
            raise ValueError(
                f"keys and values must share a [layers, kv_heads, tokens, head_dim] shape, "
                f"got {tuple(self.keys.shape)} and {tuple(self.values.shape)}"
            )
        if self.keys.dtype != self.values.dtype:
            raise ValueError("keys and values must share a dtype")

    @property
    def num_layers(self) -> int:
        return int(self.keys.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def nbytes(self) -> int:
        return int(self.keys.numel() * self.keys.element_size() * 2)
