"""Layer-by-layer execution over a Hugging Face Llama-family model's own modules.

Blending needs what ``model.forward`` cannot give: run a layer for *some* tokens only, with queries at
arbitrary positions attending over a KV buffer that mixes cached and fresh rows, and look at a layer's
fresh K/V before deciding who continues. So the executor exposes a layer as two halves —
:meth:`Executor.project` (input norm, q/k/v projections, RoPE) and :meth:`Executor.finish` (attention,
o_proj, residual, post-attention norm, MLP, residual) — built from the model's own modules
(embed_tokens, input_layernorm, q/k/v/o_proj with their biases for Qwen2, the model's ``rotary_emb``
so ``llama3``/linear scaling are the model's, post_attention_layernorm, mlp, norm, lm_head). Nothing is
re-implemented except the attention call itself (SDPA with grouped-query heads).

Tensors keep a leading batch dimension of 1 so shapes match Hugging Face's: hidden ``[1, n, hidden]``,
q ``[1, heads, n, d]``, k/v ``[1, kv_heads, n, d]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvshard_sidecar.engine.model import UnsupportedModelError, check_supported
from kvshard_sidecar.engine.rope import apply_rotary

_LAYER_PARTS = (
    "input_layernorm", "self_attn", "post_attention_layernorm", "mlp",
)
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class Shape:
    """The dimensions the engine needs, read from the model config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int


class Executor:
    """Runs a Llama-family causal LM one layer-half at a time (no grad, no HF cache objects)."""

    def __init__(self, model: Any) -> None:
        config = model.config
        check_supported(config)
        inner: Any = getattr(model, "model", None)
        missing = [name for name in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(inner, name)]
        if missing or not hasattr(model, "lm_head"):
            raise UnsupportedModelError(
                f"model {type(model).__name__} lacks the Llama-family modules the engine drives: "
                f"missing {missing or ['lm_head']}"
            )
        for index, layer in enumerate(inner.layers):
            absent = [p for p in _LAYER_PARTS if not hasattr(layer, p)]
            absent += [p for p in _ATTN_PARTS if not hasattr(getattr(layer, "self_attn", None), p)]
            if absent:
                raise UnsupportedModelError(f"layer {index} lacks {absent}: not a Llama-family decoder layer")
        self.model = model
        self.embed_tokens = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = model.lm_head
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        self.shape = Shape(
            num_layers=len(self.layers), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            hidden_size=int(config.hidden_size), vocab_size=int(config.vocab_size),
        )
        self.scaling = float(getattr(self.layers[0].self_attn, "scaling", head_dim**-0.5))
        param = next(model.parameters())
        self.device: torch.device = param.device
        self.dtype: torch.dtype = param.dtype

    @property
    def inv_freq(self) -> torch.Tensor:
        """RoPE frequencies ω_i (already scaled for linear/llama3), used to re-rotate cached keys."""
        freq: torch.Tensor = self.rotary_emb.inv_freq
        return freq

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` token ids → ``[1, n, hidden]``."""
        out: torch.Tensor = self.embed_tokens(token_ids.to(self.device).reshape(1, -1))
        return out

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own ``cos``/``sin`` for ``positions`` (``[1, 1, n, d]``, ready to broadcast)."""
        probe = torch.empty(0, device=self.device, dtype=self.dtype)
        cos, sin = self.rotary_emb(probe, positions.to(self.device).reshape(1, -1))
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def project(
        self, layer: int, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """First half of a layer: q ``[1,H,n,d]`` and RoPE'd k, v ``[1,KV,n,d]`` for ``hidden``."""
        block = self.layers[layer]
        attn = block.self_attn
        normed = block.input_layernorm(hidden)
        n, d = hidden.shape[1], self.shape.head_dim
        q = attn.q_proj(normed).view(1, n, -1, d).transpose(1, 2)
        k = attn.k_proj(normed).view(1, n, -1, d).transpose(1, 2)
        v = attn.v_proj(normed).view(1, n, -1, d).transpose(1, 2)
        cos, sin = rope
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def finish(
        self,
        layer: int,
        hidden: torch.Tensor,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool = False,
    ) -> torch.Tensor:
        """Second half of a layer for the ``n`` rows of ``hidden``/``q``.

        ``keys``/``values`` (``[1, KV, N, d]``) hold every position the queries may see; ``mask`` is a
        boolean ``[n, N]`` (True = may attend) or ``None`` with ``causal=True`` when queries and keys are
        the same positions ``0..N-1``, or ``None`` alone when every query sees every key.
        """
        block = self.layers[layer]
        attended = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=causal and mask is None,
            scale=self.scaling, enable_gqa=self.shape.num_kv_heads != self.shape.num_heads,
        )
        n = hidden.shape[1]
        hidden = hidden + block.self_attn.o_proj(attended.transpose(1, 2).reshape(1, n, -1))
        out: torch.Tensor = hidden + block.mlp(block.post_attention_layernorm(hidden))
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``[1, n, hidden]`` → float32 ``[n, vocab]``."""
        out: torch.Tensor = self.lm_head(self.norm(hidden))[0]
        return out.float()
