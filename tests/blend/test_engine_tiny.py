"""The engine on tiny random models of each supported family: no weights needed, runs in seconds.

These pin the executor to Hugging Face's own forward (Llama with ``llama3`` rope scaling, Qwen2 with
q/k/v biases, GQA) and check that every selector at r = 1 is a full prefill.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from blend_helpers import TINY_IDENTITY, tiny_model, tiny_prompt

from kvshard.segments import Prompt
from kvshard_sidecar.engine import BlendEngine, BlendSettings, MemoryBlockSource, UnsupportedModelError
from kvshard_sidecar.engine.executor import Executor
from kvshard_sidecar.engine.model import check_supported

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
NEUTRAL = (11, 12, 13)
FAMILIES = [("llama", None), ("llama", LLAMA3), ("qwen2", None)]


def hf_last_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        out: torch.Tensor = model(torch.tensor([ids])).logits[0, -1]
    return out


@pytest.mark.parametrize(("family", "rope"), FAMILIES)
def test_full_prefill_matches_the_hugging_face_forward(family: str, rope: dict[str, Any] | None) -> None:
    model = tiny_model(family, rope)
    prompt = tiny_prompt()
    engine = BlendEngine(model, TINY_IDENTITY)
    torch.testing.assert_close(engine.full(prompt).logits, hf_last_logits(model, prompt.token_ids),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("family", "rope"), FAMILIES)
@pytest.mark.parametrize("context", ["standalone", "system", "neutral"])
@pytest.mark.parametrize("selector", ["boundary", "deviation", "hybrid"])
def test_every_selector_at_ratio_one_reproduces_full(
    family: str, rope: dict[str, Any] | None, context: str, selector: str
) -> None:
    model = tiny_model(family, rope)
    prompt = tiny_prompt()
    engine = BlendEngine(model, TINY_IDENTITY)
    full = engine.full(prompt)
    settings = BlendSettings(selector=selector, ratio=1.0, prefill_context=context,  # type: ignore[arg-type]
                             neutral_context=NEUTRAL if context == "neutral" else ())
    result = engine.blend(prompt, settings)
    torch.testing.assert_close(result.logits, full.logits, atol=1e-5, rtol=1e-5)
    n = result.num_tokens
    torch.testing.assert_close(result.kv.keys[:, :, :n], full.kv.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.kv.values[:, :, :n], full.kv.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("selector", ["none", "boundary", "deviation", "hybrid"])
def test_low_ratio_differs_from_full_so_the_checks_can_fail(selector: str) -> None:
    model = tiny_model("llama", seed=3)
    prompt = tiny_prompt()
    engine = BlendEngine(model, TINY_IDENTITY)
    full = engine.full(prompt)
    result = engine.blend(prompt, BlendSettings(selector=selector, ratio=0.1,  # type: ignore[arg-type]
                                                prefill_context="standalone"))
    assert (result.logits - full.logits).abs().max() > 1e-3
    assert result.ideal_speedup > 1.0


def test_cold_path_stores_blocks_then_hits_them_by_kind_and_tier() -> None:
    model = tiny_model("llama")
    prompt = tiny_prompt()
    store = MemoryBlockSource()
    engine = BlendEngine(model, TINY_IDENTITY, store)
    cold = engine.blend(prompt)
    assert cold.cold and not cold.hit_tokens
    assert sum(cold.computed_tokens.values()) == len(prompt) - len(prompt.segments[-1])
    assert len(store) == len(prompt.segments) - 1
    hot = engine.blend(prompt)
    assert not hot.cold
    assert hot.hit_tokens["item"]["memory"] == cold.computed_tokens["item"]
    assert "instruction" not in hot.hit_tokens and hot.query_tokens["instruction"] == len(prompt.segments[-1])
    torch.testing.assert_close(hot.logits, cold.logits)


def test_standalone_and_system_blocks_never_share_keys() -> None:
    engine = BlendEngine(tiny_model("llama"), TINY_IDENTITY)
    prompt = tiny_prompt()
    standalone = engine.block_keys(prompt, BlendSettings(prefill_context="standalone"))
    system = engine.block_keys(prompt, BlendSettings(prefill_context="system"))
    assert standalone[0] == system[0]  # the system block itself is standalone in both
    assert not set(standalone[1:]) & set(system[1:])


def test_neutral_context_blocks_differ_from_system_blocks_and_keep_the_exact_prefix() -> None:
    engine = BlendEngine(tiny_model("llama"), TINY_IDENTITY)
    prompt = tiny_prompt()
    system = engine.block_keys(prompt, BlendSettings(prefill_context="system"))
    neutral_settings = BlendSettings(prefill_context="neutral", neutral_context=NEUTRAL)
    neutral = engine.block_keys(prompt, neutral_settings)
    assert neutral[:2] == system[:2]  # system and the segment right after it: the same exact blocks
    assert not set(neutral[2:]) & set(system[2:])
    result = engine.blend(prompt, neutral_settings.with_(selector="none"))
    assert result.exact_prefix_tokens == len(prompt.segments[0]) + len(prompt.segments[1])
    assert "free" not in result.computed_tokens or result.computed_tokens["free"] == sum(
        len(s) for s in prompt.segments[:-1] if s.kind.value == "free")  # the neutral text is not counted


def test_block_prefilled_behind_the_system_is_stored_at_position_zero() -> None:
    model = tiny_model("llama")
    engine = BlendEngine(model, TINY_IDENTITY)
    prompt = tiny_prompt()
    system = engine.prefill_segment(prompt.segments[0])
    behind = engine.prefill_segment(prompt.segments[1], context=system)
    full = engine.full(type(prompt).of(prompt.segments[:2]))  # system + history: a true prefix
    start = len(prompt.segments[0])
    from kvshard_sidecar.engine.rope import rotate_keys

    executor = engine.executor
    moved = torch.stack([rotate_keys(behind.keys[layer], start, executor.inv_freq) for layer in range(3)])
    torch.testing.assert_close(moved, full.kv.keys[:, :, start:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(behind.values, full.kv.values[:, :, start:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("behind_system", [False, True])
def test_batched_segment_prefill_equals_one_prefill_per_segment(behind_system: bool) -> None:
    engine = BlendEngine(tiny_model("llama"), TINY_IDENTITY)
    prompt = tiny_prompt()
    context = engine.prefill_segment(prompt.segments[0]) if behind_system else None
    batched = engine.prefill_segments(prompt.segments[1:], context)
    for segment, block in zip(prompt.segments[1:], batched, strict=True):
        alone = engine.prefill_segment(segment, context)
        assert block.keys.shape == alone.keys.shape == (3, 2, len(segment), 16)
        torch.testing.assert_close(block.keys, alone.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(block.values, alone.values, atol=1e-5, rtol=1e-5)


def test_decode_on_blended_kv_at_ratio_one_equals_full_decode() -> None:
    model = tiny_model("qwen2")
    engine = BlendEngine(model, TINY_IDENTITY)
    prompt = tiny_prompt()
    full = engine.decode(engine.full(prompt), 6, keep_logits=True)
    blended = engine.decode(engine.blend(prompt, BlendSettings(ratio=1.0)), 6, keep_logits=True)
    assert blended.token_ids == full.token_ids
    for a, b in zip(blended.logits, full.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    reference = model.generate(torch.tensor([prompt.token_ids]), max_new_tokens=6, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert full.token_ids == reference


def test_gpt2_is_refused_with_a_message_naming_the_supported_family() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match=r"model_type 'gpt2' is not supported.*Llama-family"):
        Executor(model)


def test_dynamic_ntk_rope_is_refused_with_a_message_saying_why() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                         rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match=r"'dynamic' is not supported.*frequencies"):
        check_supported(config)


def test_the_sidecar_block_store_serves_as_block_source_with_disk_hits(tmp_path: Any) -> None:
    from kvshard_sidecar.blockstore import BlockStore

    model = tiny_model("llama")
    prompt = tiny_prompt()
    first = BlendEngine(model, TINY_IDENTITY, BlockStore(64 << 20, tmp_path, 64 << 20))
    cold = first.blend(prompt)
    # a new process with the same disk folder: every block comes from disk, and the result is the same
    second = BlendEngine(model, TINY_IDENTITY, BlockStore(64 << 20, tmp_path, 64 << 20))
    warm = second.blend(prompt)
    assert not warm.cold
    assert set(warm.hit_tokens["item"]) == {"disk"}
    torch.testing.assert_close(warm.logits, cold.logits)


@pytest.mark.parametrize("context", ["standalone", "system", "neutral"])
def test_warming_segment_by_segment_makes_the_request_fully_hot(context: str) -> None:
    model = tiny_model("llama")
    prompt = tiny_prompt()
    settings = BlendSettings(prefill_context=context,  # type: ignore[arg-type]
                             neutral_context=NEUTRAL if context == "neutral" else ())
    engine = BlendEngine(model, TINY_IDENTITY, MemoryBlockSource(), settings)
    system, *middle, _ = prompt.segments
    computed = {}
    for segment in middle:
        for kind, tokens in engine.ensure_blocks(Prompt.of([system, segment])).items():
            computed[kind] = computed.get(kind, 0) + tokens
    assert computed["item"] == sum(len(s) for s in middle if s.kind.value == "item")
    assert engine.ensure_blocks(Prompt.of([system, middle[-1]])) == {}  # already stored
    warm = engine.blend(prompt)
    assert not warm.cold
    cold = BlendEngine(model, TINY_IDENTITY, MemoryBlockSource(), settings).blend(prompt)
    assert cold.cold
    torch.testing.assert_close(warm.logits, cold.logits, atol=1e-5, rtol=1e-5)
