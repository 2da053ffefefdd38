"""RoPE re-rotation of cached keys: why a block computed at one position serves at any other.

Blocks store keys as a prefill at positions ``0 .. T-1`` produces them (see
:mod:`kvshard_sidecar.blockstore.block`). RoPE rotates each pair of key dimensions by the angle
``p·ω_i``; rotations compose, ``R(p + δ) = R(δ)·R(p)``, so a key computed at position ``p`` is moved
to ``p + δ`` by rotating it once more by ``δ·ω_i`` — no pre-RoPE copy is needed. This holds for every
rope type whose frequencies ``ω_i`` do not depend on the sequence length (default, linear and
Llama-3 ``llama3`` scaling fold their scaling into ``inv_freq``); dynamic NTK changes ``ω`` with the
length, so :func:`kvshard_sidecar.engine.model.check_supported` refuses it.

The pair layout is Hugging Face's ``rotate_half`` (dimension ``i`` pairs with ``i + d/2``), the layout
the model's own attention uses. Angles are computed in float64 and the rotation in float32 whatever
the KV dtype, so a bf16 cache loses no more than one rounding per re-rotation. The model's
``attention_scaling`` is not applied here: cached keys already carry it once.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension (Hugging Face's pair layout)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE given per-token ``cos``/``sin`` of shape broadcastable to ``x`` (``[..., tokens, d]``)."""
    return x * cos + rotate_half(x) * sin


def rotation_tables(
    delta: torch.Tensor | int, inv_freq: torch.Tensor, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` of ``δ·ω`` with shape ``[len(δ), head_dim]`` (float32); ``δ`` scalar or per-token."""
    deltas = torch.as_tensor(delta, dtype=torch.float64, device=device or inv_freq.device).reshape(-1)
    angles = deltas[:, None] * inv_freq.to(device=deltas.device, dtype=torch.float64)[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(torch.float32), angles.sin().to(torch.float32)


def rotate_keys(keys: torch.Tensor, delta: torch.Tensor | int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move RoPE'd ``keys`` (``[..., tokens, head_dim]``) by ``delta`` positions.

    ``delta`` is one int for all tokens or a tensor with one shift per token. ``delta == 0`` returns
    ``keys`` unchanged (bit for bit), which is what makes a block at offset 0 exact.
    """
    if isinstance(delta, int) and delta == 0:
        return keys
    tokens = keys.shape[-2]
    cos, sin = rotation_tables(delta, inv_freq, device=keys.device)
    if cos.shape[0] not in (1, tokens):
        raise ValueError(f"{cos.shape[0]} shifts for {tokens} tokens")
    rotated = apply_rotary(keys.to(torch.float32), cos, sin)
    return rotated.to(keys.dtype)


def inv_freq_for(config: object) -> torch.Tensor:
    """The RoPE frequencies ``ω`` of a Llama-family Hugging Face config, scaling included (``llama3``,
    ``linear``): the very module the model's attention uses builds them, so a process that holds no
    weights (vLLM's connector) rotates keys exactly as the blend engine does."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    frequencies: torch.Tensor = LlamaRotaryEmbedding(config).inv_freq  # type: ignore[arg-type]
    return frequencies.to(torch.float32)
