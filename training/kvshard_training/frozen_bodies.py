"""Item bodies through the frozen layers, computed once: a late scorer's training step without them.

Why. LoRA on the top ``--layers`` leaves the layers below them frozen, and a late scorer's item body — the
item's tokens but its last ``interaction`` — reads only its own item. Below the first adapted layer a
body's hidden states, keys and values are therefore a function of the item alone (with RoPE the block's
start is a rotation of its keys, nothing more), the same in every prompt and at every step: the blend
engine serves exactly these rows from its cached item blocks. Yet a training forward computed them in every
prompt, ~200 of a MovieLens prompt's ~510 rows through the 15 frozen layers of the shipped recipe.

:class:`FrozenBodies` computes each body once through the frozen layers — alone, from position 0, as the
blend engine's item block is computed — keeps its keys and values per layer and its hidden state where
the adapted layers begin, and runs a training forward in two parts:

* below the first adapted layer, only the rows that read the history: the prefix, and each block's readers
  (its last ``interaction`` item rows and its label opening), which attend to their prefix, to their body's
  cached keys and values rotated to the block's start, and to themselves (:class:`ReaderLayout`);
* from the first adapted layer on, every row — the bodies' hidden states put back — under the block
  attention of :mod:`kvshard_training.block_attention`.

The scores and gradients are the block attention's up to floating-point order (tests). The cache is bounded
(``--body-cache-mib``, least recently used out): a body computed alone costs what it cost inside a prompt,
so a catalog larger than the cache loses only the hits. Measured side by side:
``bench/experiments/training_step_rows.py`` (docs/experiments.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, padded_prompts, prompts_readout_scores
from kvshard_training.block_attention import BlockLayout, attention_of, block_scores, small_attention

Tokens = tuple[int, ...]


def first_adapted_layer(causal_lm: Any) -> int:
    """The index of the lowest decoder layer with a trainable parameter (0 when the embeddings train, the
    layer count when nothing does): the layers below it are frozen."""
    decoder = causal_lm.model
    if any(p.requires_grad for p in decoder.embed_tokens.parameters()):
        return 0
    for index, layer in enumerate(decoder.layers):
        if any(p.requires_grad for p in layer.parameters()):
            return index
    return len(decoder.layers)


def body_of(prompt: IsolatedInputs, block: int) -> Tokens:
    """The tokens of a late scorer's block ``block`` that read only their item (empty when the item is no
    longer than ``interaction``)."""
    assert prompt.interaction is not None
    start, _ = prompt.blocks[block]
    return prompt.token_ids[start:max(start, prompt.readouts[block] - prompt.interaction)]


@dataclass(frozen=True)
class Body:
    """One item body through the frozen layers: ``keys`` and ``values`` [frozen, kv heads, L, d] (keys
    rotated to positions 0 … L-1) and ``hidden`` [L, hidden size], the first adapted layer's input."""

    keys: torch.Tensor
    values: torch.Tensor
    hidden: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.hidden))


class _Recording:
    """The layout of bodies computed alone: causal attention over each padded body (pads at the end, so no
    real row reads one), every layer's keys and values kept."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        self.keys[layer], self.values[layer] = key, value
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                  enable_gqa=query.shape[1] != key.shape[1])
        return attended.transpose(1, 2)


def rotated(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE by the angles of ``cos``/``sin`` (transformers' own half-split rotation): keys rotated at
    position p, rotated again by position q, stand at p + q."""
    from transformers.models.llama.modeling_llama import rotate_half

    turned: torch.Tensor = rotate_half(keys)  # type: ignore[no-untyped-call]
    return keys * cos + turned * sin


@dataclass(frozen=True)
class ReaderLayout:
    """The rows below the first adapted layer: each prompt's prefix (rows 0 … P_n-1) and then its blocks'
    readers, padded to T' rows. Block m's ``reader_rows`` [M · R] (R the most readers; a pad repeats the
    first) attend to their prompt's first P rows, then their body's ``body_keys``/``body_values``
    [frozen, M, kv heads, B, d] (B the longest body), then their own readers, under ``mask`` [M, 1, R, P + B
    + R]; ``gather`` [N · T'] takes each output row from the prefixes', the readers' or a zero row."""

    prefix: int
    block_prompt: torch.Tensor
    reader_rows: torch.Tensor
    prefix_keys: torch.Tensor
    body_keys: torch.Tensor
    body_values: torch.Tensor
    mask: torch.Tensor
    gather: torch.Tensor

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        batch, heads, length, dim = query.shape
        kv_heads = key.shape[1]
        prefix = F.scaled_dot_product_attention(query[:, :, :self.prefix], key[:, :, :self.prefix],
                                                value[:, :, :self.prefix], is_causal=True, scale=scaling,
                                                enable_gqa=heads != kv_heads)
        blocks, readers = self.mask.shape[0], self.mask.shape[2]
        rows_prompt = self.block_prompt.repeat_interleave(readers)
        keys_prompt = self.block_prompt.repeat_interleave(self.prefix)
        q = query[rows_prompt, :, self.reader_rows].view(blocks, readers, heads, dim).transpose(1, 2)

        def keys_of(states: torch.Tensor, bodies: torch.Tensor) -> torch.Tensor:
            own_prefix = states[keys_prompt, :, self.prefix_keys].view(blocks, self.prefix, kv_heads, dim)
            own_rows = states[rows_prompt, :, self.reader_rows].view(blocks, readers, kv_heads, dim)
            return torch.cat([own_prefix.transpose(1, 2), bodies.to(states.dtype), own_rows.transpose(1, 2)], 2)

        attended = small_attention(q, keys_of(key, self.body_keys[layer]), keys_of(value, self.body_values[layer]),
                                   self.mask, scaling)
        source = torch.cat([prefix.transpose(1, 2).reshape(-1, heads, dim),
                            attended.transpose(1, 2).reshape(-1, heads, dim), query.new_zeros(1, heads, dim)])
        return source[self.gather].view(batch, length, heads, dim)


class FrozenBodies:
    """The bodies a late scorer's training has met, through the frozen layers of ``causal_lm`` (computed
    with the base weights below :func:`first_adapted_layer`, which training never changes), at most
    ``capacity`` bytes, and the two-part training forward that reads them (:meth:`scores`)."""

    def __init__(self, causal_lm: Any, capacity: int) -> None:
        self.causal_lm = causal_lm
        # a rotary embedding that scales its cos/sin (YaRN's attention factor) would scale a key rotated twice
        exact_rotation = getattr(causal_lm.model.rotary_emb, "attention_scaling", 1.0) == 1.0
        self.frozen = first_adapted_layer(causal_lm) if exact_rotation else 0
        self.capacity = capacity
        self.bodies: OrderedDict[Tokens, Body] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = 0

    def scores(self, prompts: Sequence[IsolatedInputs], readout: int) -> list[torch.Tensor]:
        """:func:`~kvshard_training.block_attention.block_scores` of late ``prompts``, the bodies' rows
        skipped below the first adapted layer; the block attention alone where nothing is frozen or a
        prompt is not a late scorer's."""
        if self.frozen == 0 or any(p.interaction is None for p in prompts):
            return block_scores(self.causal_lm, prompts, readout)
        decoder, device = self.causal_lm.model, self.causal_lm.device
        autocast = self.causal_lm.dtype == torch.bfloat16
        bodies = self._bodies([body_of(p, b) for p in prompts for b in range(len(p.blocks))])
        ids, positions = padded_prompts(prompts)
        unused = torch.ones(len(prompts), 1, 1, 1, dtype=torch.bool, device=device)
        with attention_of(self.causal_lm), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            with torch.no_grad():
                reduced, layout, gather = self._readers(prompts, bodies)
                hidden = decoder.embed_tokens(reduced[0].to(device))
                embeddings = decoder.rotary_emb(hidden, position_ids=reduced[1].to(device))
                for layer in decoder.layers[:self.frozen]:
                    hidden = layer(hidden, attention_mask=unused, position_ids=reduced[1],
                                   position_embeddings=embeddings, block_layout=layout)
                rows = [hidden.reshape(-1, hidden.shape[-1])] + [b.hidden.to(hidden.dtype) for b in bodies]
                hidden = torch.cat([*rows, hidden.new_zeros(1, hidden.shape[-1])])[gather.to(device)]
                hidden = hidden.view(len(prompts), ids.shape[1], -1)
            full = BlockLayout.of(prompts, ids.shape[1]).to(device, torch.bfloat16 if autocast else hidden.dtype)
            positions = positions.to(device)
            embeddings = decoder.rotary_emb(hidden, position_ids=positions)
            for layer in decoder.layers[self.frozen:]:
                hidden = layer(hidden, attention_mask=unused, position_ids=positions, position_embeddings=embeddings,
                               block_layout=full)
            hidden = decoder.norm(hidden)
        return prompts_readout_scores(self.causal_lm, prompts, hidden, readout)

    def _bodies(self, wanted: Sequence[Tokens]) -> list[Body]:
        """The bodies of ``wanted``, those not cached computed together (:meth:`_compute`), the least
        recently used evicted beyond the capacity (never one of these)."""
        missing = list(dict.fromkeys(t for t in wanted if t not in self.bodies))
        self.misses += len(missing)
        self.hits += len(set(wanted)) - len(missing)
        computed = dict(zip(missing, self._compute(missing), strict=True)) if missing else {}
        for tokens, body in computed.items():
            self.bodies[tokens] = body
            self.nbytes += body.nbytes
        for tokens in dict.fromkeys(wanted):
            self.bodies.move_to_end(tokens)
        while self.nbytes > self.capacity and len(self.bodies) > len(set(wanted)):
            self.nbytes -= self.bodies.popitem(last=False)[1].nbytes
        return [self.bodies[t] for t in wanted]

    def _compute(self, bodies: Sequence[Tokens]) -> list[Body]:
        """Bodies alone through the frozen layers, from position 0 (as the blend engine's blocks), in one
        padded pass: pads at the end, and causal attention keeps every real row off them."""
        decoder, device = self.causal_lm.model, self.causal_lm.device
        longest = max(1, max(map(len, bodies)))
        ids = torch.zeros(len(bodies), longest, dtype=torch.long)
        for row, tokens in enumerate(bodies):
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        positions = torch.arange(longest, device=device)[None].expand(len(bodies), -1)
        recording = _Recording()
        autocast = self.causal_lm.dtype == torch.bfloat16
        unused = torch.ones(len(bodies), 1, 1, 1, dtype=torch.bool, device=device)
        with torch.no_grad(), attention_of(self.causal_lm), torch.autocast(device.type, dtype=torch.bfloat16,
                                                                           enabled=autocast):
            hidden = decoder.embed_tokens(ids.to(device))
            embeddings = decoder.rotary_emb(hidden, position_ids=positions)
            for layer in decoder.layers[:self.frozen]:
                hidden = layer(hidden, attention_mask=unused, position_ids=positions, position_embeddings=embeddings,
                               block_layout=recording)
        keys = torch.stack([recording.keys[i] for i in range(self.frozen)], dim=1)
        values = torch.stack([recording.values[i] for i in range(self.frozen)], dim=1)
        return [Body(keys[row, :, :, :len(tokens)].clone(), values[row, :, :, :len(tokens)].clone(),
                     hidden[row, :len(tokens)].clone()) for row, tokens in enumerate(bodies)]

    def _readers(self, prompts: Sequence[IsolatedInputs], bodies: Sequence[Body]
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor], ReaderLayout, torch.Tensor]:
        """The reduced prompts (token ids and positions [N, T']), their :class:`ReaderLayout` and the
        ``gather`` [N · T] that rebuilds the full rows from [the reduced rows; every body's rows; a zero]."""
        device = self.causal_lm.device
        prefix = max(p.prefix for p in prompts)
        flat = iter(len(body.hidden) for body in bodies)  # in the prompts' block order
        lengths = [[next(flat) for _ in p.blocks] for p in prompts]
        kept = [list(range(p.prefix)) + [row for (start, stop), length in zip(p.blocks, lengths[n], strict=True)
                                         for row in range(start + length, stop)]
                for n, p in enumerate(prompts)]
        reduced_length, full_length = max(map(len, kept)), max(len(p.token_ids) for p in prompts)
        readers = max(stop - start - length for p, each in zip(prompts, lengths, strict=True)
                      for (start, stop), length in zip(p.blocks, each, strict=True))
        longest_body = max(max(each) for each in lengths)
        ids = torch.zeros(len(prompts), reduced_length, dtype=torch.long)
        positions = torch.zeros(len(prompts), reduced_length, dtype=torch.long)
        reduced_rows = len(prompts) * reduced_length
        full_gather = torch.full((len(prompts), full_length), reduced_rows + sum(len(b.hidden) for b in bodies),
                                 dtype=torch.long)
        gather = torch.full((len(prompts), reduced_length), len(prompts) * prefix + len(bodies) * readers,
                            dtype=torch.long)
        reader_rows: list[torch.Tensor] = []
        prefix_keys: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        block_prompt: list[int] = []
        starts: list[int] = []
        own_prefix, offsets = torch.arange(prefix), torch.arange(readers)
        body_row = reduced_rows
        for n, prompt in enumerate(prompts):
            ids[n, :len(kept[n])] = torch.tensor([prompt.token_ids[r] for r in kept[n]])
            positions[n, :len(kept[n])] = prompt.positions()[kept[n]]
            gather[n, :prompt.prefix] = n * prefix + torch.arange(prompt.prefix)
            full_gather[n, :prompt.prefix] = n * reduced_length + torch.arange(prompt.prefix)
            at = prompt.prefix
            for b, (start, stop) in enumerate(prompt.blocks):
                length = lengths[n][b]
                count = stop - start - length
                full_gather[n, start:start + length] = body_row + torch.arange(length)
                body_row += length
                full_gather[n, start + length:stop] = n * reduced_length + at + torch.arange(count)
                first = len(prompts) * prefix + len(reader_rows) * readers
                gather[n, at:at + count] = first + torch.arange(count)
                real = offsets < count
                reader_rows.append(at + torch.where(real, offsets, 0))
                block_prompt.append(n)
                starts.append(prompt.prefix)
                prefix_keys.append(own_prefix.clamp(max=prompt.prefix - 1))
                own = (offsets[None, :] <= offsets[:, None]) & real[None, :]
                own |= ~real[:, None] & (offsets[None, :] == 0)  # a pad row reads one key: no 0/0
                masks.append(torch.cat([(own_prefix < prompt.prefix).expand(readers, -1),
                                        (torch.arange(longest_body) < length).expand(readers, -1), own], dim=1))
                at += count
        dtype = torch.bfloat16 if self.causal_lm.dtype == torch.bfloat16 else self.causal_lm.dtype
        cos, sin = self.causal_lm.model.rotary_emb(torch.zeros(1, device=device, dtype=torch.float32),
                                                   position_ids=torch.tensor([starts], device=device))
        cos, sin = cos[0][None, :, None, None], sin[0][None, :, None, None]  # [1, M, 1, 1, d]

        def padded(states: Sequence[torch.Tensor]) -> torch.Tensor:  # [frozen, kv heads, L, d] each
            return torch.stack([F.pad(s, (0, 0, 0, longest_body - s.shape[2])) for s in states], dim=1)

        layout = ReaderLayout(prefix, torch.tensor(block_prompt, device=device),
                              torch.stack(reader_rows).reshape(-1).to(device),
                              torch.stack(prefix_keys).reshape(-1).to(device),
                              rotated(padded([b.keys for b in bodies]), cos, sin),
                              padded([b.values for b in bodies]),
                              torch.where(torch.stack(masks)[:, None], 0.0, float("-inf")).to(device, dtype),
                              gather.reshape(-1).to(device))
        return (ids, positions), layout, full_gather.reshape(-1)
