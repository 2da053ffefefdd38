"""Re-rotating cached keys is exact algebra: rotations compose and match the model's own RoPE."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshard_sidecar.engine.rope import apply_rotary, rotate_keys

INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
KEYS = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))


@settings(max_examples=60, deadline=None)
@given(a=st.integers(-4096, 4096), b=st.integers(-4096, 4096))
def test_rotating_by_a_then_b_equals_rotating_by_a_plus_b(a: int, b: int) -> None:
    twice = rotate_keys(rotate_keys(KEYS, a, INV_FREQ), b, INV_FREQ)
    once = rotate_keys(KEYS, a + b, INV_FREQ)
    torch.testing.assert_close(twice, once, atol=2e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(a=st.integers(-2048, 2048))
def test_rotation_then_inverse_is_identity_and_preserves_norms(a: int) -> None:
    rotated = rotate_keys(KEYS, a, INV_FREQ)
    torch.testing.assert_close(rotated.norm(dim=-1), KEYS.norm(dim=-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotate_keys(rotated, -a, INV_FREQ), KEYS, atol=2e-5, rtol=1e-5)


def test_rotation_by_zero_is_bit_exact() -> None:
    assert torch.equal(rotate_keys(KEYS, 0, INV_FREQ), KEYS)
    assert torch.equal(rotate_keys(KEYS, torch.zeros(5, dtype=torch.long), INV_FREQ), KEYS)


def test_per_token_shifts_rotate_each_row_by_its_own_delta() -> None:
    shifts = torch.tensor([0, 3, 3, 100, 7])
    moved = rotate_keys(KEYS, shifts, INV_FREQ)
    for row, delta in enumerate(shifts.tolist()):
        torch.testing.assert_close(moved[:, row], rotate_keys(KEYS[:, row : row + 1], delta, INV_FREQ)[:, 0])


def test_rerotated_key_equals_the_models_own_rope_at_the_new_position_llama3_scaling() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=8192,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64})
    rotary = LlamaRotaryEmbedding(config)
    raw = torch.randn(1, 2, 4, 16, generator=torch.Generator().manual_seed(1))

    def rope_at(positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary(raw, positions.reshape(1, -1))
        return apply_rotary(raw, cos.unsqueeze(1), sin.unsqueeze(1))

    at_zero = rope_at(torch.arange(4))
    for delta in (1, 37, 900, 5000):
        torch.testing.assert_close(rotate_keys(at_zero, delta, rotary.inv_freq),
                                   rope_at(torch.arange(4) + delta), atol=1e-4, rtol=1e-4)


def test_the_connectors_rotation_equals_the_models_own_rope_with_llama3_scaling() -> None:
    """vLLM's connector holds no weights: it rotates an item block (prefilled alone at 0..T-1) to where the
    item stands with frequencies built from the config alone (``inv_freq_for``). Those must be the model's
    — llama3 scaling included — and the rotated keys must be what the model computes at those positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvshard_sidecar.engine.rope import inv_freq_for

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                         rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    frequencies = inv_freq_for(config)
    torch.testing.assert_close(frequencies, model.model.rotary_emb.inv_freq.float(), atol=0, rtol=0)
    assert not torch.allclose(frequencies, 1.0 / (500000.0 ** (torch.arange(0, 16, 2) / 16)))  # scaling applied
    tokens = torch.tensor([[5, 9, 2, 33, 17, 8]])

    def keys_at(offset: int) -> torch.Tensor:
        positions = torch.arange(offset, offset + tokens.shape[1])[None]
        with torch.no_grad():
            cache = model(input_ids=tokens, position_ids=positions, use_cache=True).past_key_values
        return torch.stack([layer.keys[0] for layer in cache.layers])  # [layers, kv_heads, tokens, head_dim]

    alone = keys_at(0)
    for offset in (1, 37, 900, 9000):  # beyond original_max_position_embeddings too
        torch.testing.assert_close(rotate_keys(alone, offset, frequencies), keys_at(offset), atol=2e-5, rtol=1e-4)
