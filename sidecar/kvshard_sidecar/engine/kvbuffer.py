"""The blended KV of one request: every layer's K and V rows, indexed by token position.

Row ``p`` of every layer holds position ``p``'s key (RoPE'd at ``p``) and value, whether it came from
a cached block or was just recomputed; that is what lets selected queries attend over "the blended KV
of all tokens with a causal mask by position". One preallocated tensor pair (not a list of
per-layer tensors, not Hugging Face cache objects) keeps writes in place and lets decoding append
without copying the prompt rows more than once (:meth:`KVBuffer.reserve`).
"""

from __future__ import annotations

import torch


class KVBuffer:
    """``keys``/``values`` of shape ``[layers, kv_heads, capacity, head_dim]``; rows ``< length`` are valid."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        if keys.shape != values.shape or keys.dim() != 4:
            raise ValueError(f"keys and values must share a 4-d shape, got {keys.shape} and {values.shape}")
        if not 0 <= length <= keys.shape[2]:
            raise ValueError(f"length {length} outside capacity {keys.shape[2]}")
        self.keys = keys
        self.values = values
        self.length = length

    @classmethod
    def empty(
        cls, layers: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> KVBuffer:
        shape = (layers, kv_heads, capacity, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device), capacity)

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes of the valid rows (K and V)."""
        per_row = self.keys[:, :, :1].numel() * self.keys.element_size() * 2
        return int(per_row * self.length)

    def layer(self, layer: int, upto: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[1, kv_heads, upto, d]`` of one layer (default: all valid rows)."""
        end = self.length if upto is None else upto
        return self.keys[layer, :, :end].unsqueeze(0), self.values[layer, :, :end].unsqueeze(0)

    def rows(self, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies ``[kv_heads, n, d]`` of the given positions of one layer."""
        return self.keys[layer, :, positions], self.values[layer, :, positions]

    def write(self, layer: int, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite rows ``positions`` of ``layer`` with ``[1, kv_heads, n, d]`` fresh K/V."""
        self.keys[layer].index_copy_(1, positions, keys[0].to(self.keys.dtype))
        self.values[layer].index_copy_(1, positions, values[0].to(self.values.dtype))

    def reserve(self, capacity: int) -> None:
        """Grow to at least ``capacity`` rows (one copy), keeping the valid rows."""
        if capacity <= self.capacity:
            return
        grow = capacity - self.capacity
        pad = (*self.keys.shape[:2], grow, self.keys.shape[3])
        zeros = torch.zeros(pad, dtype=self.keys.dtype, device=self.keys.device)
        self.keys = torch.cat((self.keys, zeros), dim=2)
        self.values = torch.cat((self.values, zeros), dim=2)
