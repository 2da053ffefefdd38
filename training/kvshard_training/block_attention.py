"""Candidate-block attention: an isolated or late scorer's training forward without the dense mask's waste.

Why. An isolated or late scorer's prompt is a causal prefix (system turn, history, ``Candidates:``) and K
candidate blocks; each block reads the prefix and itself, never another block
(:meth:`~kvshard_sidecar.engine.isolated_scorer.IsolatedInputs.mask_and_positions`). Fed to SDPA as a dense
[T, T] mask, the CPU's tiled kernel computes every pair and throws most away: with a ~194-token prefix and
20 blocks of ~18 tokens, about 87 % of the ~600² pairs are masked, and on the shipped late recipe the
attention kernels were 39 % of a training step's CPU time. This module computes the same attention from
the layout instead:

* the prefixes attend causally to themselves (one SDPA call, ``is_causal``);
* every block's rows attend to their prompt's prefix and to their own block: the blocks of all prompts
  are gathered into one [M, heads, L, d] batch (L the longest block) against [M, kv heads, P + L, d] keys
  (P the longest prefix) and attended by two batched matmuls under a small additive mask — a late
  scorer's body rows don't see the prefix, its last ``interaction`` item rows and its label rows do, as
  the dense mask says.

The scores and gradients are the dense mask's up to floating-point summation order (tests; float32 max
score difference ~1e-5). Measured by ``bench/experiments/training_step_attention.py`` (2 cores, bf16, 15
LoRA layers, 4 examples): a forward + backward 1.14x the dense one's speed one example per pass, 1.26x four
per pass on idle cores (1.18x and 1.24x on a loaded machine); a whole ``kvshard model finetune`` step
1.06-1.07x (docs/experiments.md). It is registered as a transformers attention implementation
(``kvshard_blocks``) and switched on only for the duration of one call (:func:`block_scores`), so
validation and serving keep the model's own attention. Fine-tuning uses it on the CPU only: on a GPU the
dense SDPA kernels are another trade, not measured here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, padded_prompts, prompts_readout_scores

IMPLEMENTATION = "kvshard_blocks"


@dataclass(frozen=True)
class BlockLayout:
    """Where N padded prompts' prefixes and candidate blocks stand, as index tensors.

    ``prefix`` is the longest prefix P: the prefixes are computed together, causally over [0, P), and a
    prompt keeps its rows below its own prefix's end. The M blocks of all prompts are padded to the
    longest, L tokens: block m's rows are tokens ``block_rows[m]`` of prompt ``block_prompt[m]`` (a pad
    repeats the block's first row), its keys tokens ``block_keys[m]`` of prompt ``key_prompt[m]`` (that
    prompt's first P tokens, then the block's rows), and ``mask`` [M, 1, L, P + L] is additive (0 or
    -inf). ``gather`` [N · T] takes each output row from the prefixes' rows, the blocks' rows or, for a
    prompt's padding, a row of zeros."""

    prefix: int
    block_prompt: torch.Tensor
    block_rows: torch.Tensor
    key_prompt: torch.Tensor
    block_keys: torch.Tensor
    mask: torch.Tensor
    gather: torch.Tensor

    @classmethod
    def of(cls, prompts: Sequence[IsolatedInputs], length: int) -> BlockLayout:
        """The layout of ``prompts`` padded to ``length`` tokens; refused where the blocks do not tile
        each prompt from its prefix to its end (the dense mask would then say something this does not)."""
        prefix = max(p.prefix for p in prompts)
        span = max(stop - start for p in prompts for start, stop in p.blocks)
        blocks = sum(len(p.blocks) for p in prompts)
        zero_row = len(prompts) * prefix + blocks * span
        gather = torch.full((len(prompts), length), zero_row, dtype=torch.long)
        offsets, own_prefix = torch.arange(span), torch.arange(prefix)
        rows: list[torch.Tensor] = []
        keys: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        owners: list[int] = []
        for n, prompt in enumerate(prompts):
            ends = [prompt.prefix] + [stop for _, stop in prompt.blocks[:-1]]
            if [start for start, _ in prompt.blocks] != ends or prompt.blocks[-1][1] != len(prompt.token_ids):
                raise ValueError("candidate blocks must tile the prompt from its prefix to its end")
            gather[n, :prompt.prefix] = n * prefix + torch.arange(prompt.prefix)
            for (start, stop), opening in zip(prompt.blocks, prompt.readouts, strict=True):
                real = offsets < stop - start
                first = len(prompts) * prefix + len(rows) * span
                gather[n, start:stop] = first + torch.arange(stop - start)
                own_rows = start + torch.where(real, offsets, 0)
                rows.append(own_rows)
                keys.append(torch.cat([own_prefix.clamp(max=prompt.prefix - 1), own_rows]))
                owners.append(n)
                reads_prefix = real & (True if prompt.interaction is None
                                       else start + offsets >= opening - prompt.interaction)
                prefix_part = reads_prefix[:, None] & (own_prefix < prompt.prefix)[None, :]
                block_part = (offsets[None, :] <= offsets[:, None]) & real[None, :]
                block_part |= ~real[:, None] & (offsets[None, :] == 0)  # a pad row reads one key: no 0/0
                masks.append(torch.cat([prefix_part, block_part], dim=1))
        owner = torch.tensor(owners)
        return cls(prefix, owner.repeat_interleave(span), torch.stack(rows).reshape(-1),
                   owner.repeat_interleave(prefix + span), torch.stack(keys).reshape(-1),
                   torch.where(torch.stack(masks)[:, None], 0.0, float("-inf")), gather.reshape(-1))

    def to(self, device: torch.device, dtype: torch.dtype) -> BlockLayout:
        """On ``device``, the mask in the attention's ``dtype``."""
        return BlockLayout(self.prefix, self.block_prompt.to(device), self.block_rows.to(device),
                           self.key_prompt.to(device), self.block_keys.to(device), self.mask.to(device, dtype),
                           self.gather.to(device))

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """Attention of every row of the padded prompts under this layout: query [N, H, T, d], key and
        value [N, Hkv, T, d] → [N, T, H, d] (``layer`` is not needed: every layer reads the same layout)."""
        batch, heads, length, dim = query.shape
        prefix = F.scaled_dot_product_attention(query[:, :, :self.prefix], key[:, :, :self.prefix],
                                                value[:, :, :self.prefix], is_causal=True, scale=scaling,
                                                enable_gqa=heads != key.shape[1])
        blocks, span = self.mask.shape[0], self.mask.shape[2]
        q = query[self.block_prompt, :, self.block_rows].view(blocks, span, heads, dim).transpose(1, 2)
        k = key[self.key_prompt, :, self.block_keys].view(blocks, -1, key.shape[1], dim).transpose(1, 2)
        v = value[self.key_prompt, :, self.block_keys].view(blocks, -1, key.shape[1], dim).transpose(1, 2)
        attended = small_attention(q, k, v, self.mask, scaling)
        source = torch.cat([prefix.transpose(1, 2).reshape(-1, heads, dim),
                            attended.transpose(1, 2).reshape(-1, heads, dim), query.new_zeros(1, heads, dim)])
        return source[self.gather].view(batch, length, heads, dim)


class Layout(Protocol):
    """What :func:`block_attention` reads: a layout that attends one layer's rows (:class:`BlockLayout`;
    :mod:`kvshard_training.frozen_bodies` has the others)."""

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor: ...


def block_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    block_layout: Layout | None = None, **_: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function: query [N, H, T, d], key and value [N, Hkv, T, d] → [N, T, H, d].
    It is the model's attention only inside :func:`attention_of`, and the callers that switch it on
    (:func:`block_scores`, :class:`~kvshard_training.frozen_bodies.FrozenBodies`) always pass ``block_layout``."""
    if block_layout is None:
        raise ValueError("block_attention needs the block_layout that block_scores passes")
    return block_layout.attend(module.layer_idx, query, key, value,
                               scaling if scaling is not None else query.shape[-1] ** -0.5), None


def small_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Masked attention of short blocks as two batched matmuls: query [M, H, L, d], key and value
    [M, Hkv, S, d], mask [M, 1, L, S] → [M, H, L, d]. Why not SDPA: its CPU kernel is tiled for long
    queries, and on [80, 9, 34, 228] ran at a third of the matmuls' rate; here the heads that share a
    key head are stacked into one matmul (grouped-query attention), the softmax in float32."""
    blocks, heads, span, dim = query.shape
    groups = heads // key.shape[1]
    grouped = query.reshape(blocks, key.shape[1], groups * span, dim)
    logits = (grouped @ key.transpose(-1, -2)) * scale
    logits = logits.view(blocks, key.shape[1], groups, span, -1) + mask[:, :, None]
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(value.dtype)
    return (weights.view(blocks, key.shape[1], groups * span, -1) @ value).view(blocks, heads, span, dim)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, block_attention)


@contextmanager
def attention_of(causal_lm: Any) -> Iterator[None]:
    """The model's attention is :func:`block_attention` inside, its own again after."""
    _register()
    config = causal_lm.config
    before = config._attn_implementation
    config._attn_implementation = IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation = before


def block_scores(causal_lm: Any, prompts: Sequence[IsolatedInputs], readout: int) -> list[torch.Tensor]:
    """:func:`~kvshard_sidecar.engine.isolated_scorer.batched_isolated_scores` computed with
    :func:`block_attention`: [K] each, the same scores up to float summation order."""
    ids, positions = padded_prompts(prompts)
    length = ids.shape[1]
    device = causal_lm.device
    autocast = causal_lm.dtype == torch.bfloat16
    layout = BlockLayout.of(prompts, length).to(device, torch.bfloat16 if autocast else causal_lm.dtype)
    # a 4-D mask passes transformers' mask creation untouched; block_attention reads the layout instead
    unused = torch.ones(len(prompts), 1, 1, 1, dtype=torch.bool, device=device)
    with attention_of(causal_lm), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = causal_lm.model(input_ids=ids.to(device), attention_mask=unused, position_ids=positions.to(device),
                                 use_cache=False, block_layout=layout).last_hidden_state
    return prompts_readout_scores(causal_lm, prompts, hidden, readout)
