"""The engine on the real SmolLM2-135M-Instruct (fp32, CPU): equivalences that gate the benchmark."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvshard.segments import Prompt
from kvshard_sidecar.engine import BlendEngine, BlendSettings, MemoryBlockSource

pytestmark = pytest.mark.model

SELECTORS = ["none", "boundary", "deviation", "hybrid"]


@pytest.fixture(scope="module")
def engine(smollm2: Any) -> BlendEngine:
    return BlendEngine(smollm2.model, smollm2.identity, MemoryBlockSource())


def kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    p, q = reference.log_softmax(-1), other.log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def test_full_prefill_matches_the_models_own_forward(engine: BlendEngine, smollm2: Any, smol_prompt: Prompt) -> None:
    with torch.inference_mode():
        reference = smollm2.model(torch.tensor([smol_prompt.token_ids])).logits[0, -1]
    torch.testing.assert_close(engine.full(smol_prompt).logits, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("selector", ["boundary", "deviation", "hybrid"])
@pytest.mark.parametrize("context", ["standalone", "system"])
def test_ratio_one_reproduces_full(engine: BlendEngine, smol_prompt: Prompt, selector: str, context: str) -> None:
    full = engine.full(smol_prompt)
    settings = BlendSettings(selector=selector, ratio=1.0, prefill_context=context)  # type: ignore[arg-type]
    result = engine.blend(smol_prompt, settings)
    torch.testing.assert_close(result.logits, full.logits, atol=1e-4, rtol=1e-4)
    assert kl(full.logits, result.logits) < 1e-6


@pytest.mark.parametrize("selector", SELECTORS)
def test_single_segment_at_offset_zero_reproduces_full(engine: BlendEngine, smol_prompt: Prompt, selector: str) -> None:
    # One cached segment at offset 0 plus the uncached suffix: nothing is re-rotated or blended, so the
    # only differences left are fp32 kernel noise (GEMM blocking by row count, masked vs causal SDPA).
    prompt = Prompt.of([smol_prompt.segments[0], smol_prompt.segments[-1]])
    full = engine.full(prompt)
    result = engine.blend(prompt, BlendSettings(selector=selector, ratio=0.15))  # type: ignore[arg-type]
    head = len(prompt.segments[0])
    torch.testing.assert_close(result.kv.keys[:, :, :head], full.kv.keys[:, :, :head], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.kv.values[:, :, :head], full.kv.values[:, :, :head], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.logits, full.logits, atol=1e-4, rtol=1e-4)
    assert int(result.logits.argmax()) == int(full.logits.argmax())


def test_blending_changes_the_output_and_deviation_beats_none(engine: BlendEngine, smol_prompt: Prompt) -> None:
    full = engine.full(smol_prompt)
    standalone = BlendSettings(prefill_context="standalone")
    none = engine.blend(smol_prompt, standalone.with_(selector="none"))
    deviation = engine.blend(smol_prompt, standalone.with_(selector="deviation", ratio=0.5))
    assert kl(full.logits, none.logits) > 1e-3
    assert kl(full.logits, deviation.logits) < kl(full.logits, none.logits)


def test_decode_from_blended_kv_at_ratio_one_equals_full_decode(engine: BlendEngine, smol_prompt: Prompt) -> None:
    full = engine.decode(engine.full(smol_prompt), 5, keep_logits=True)
    blended = engine.decode(engine.blend(smol_prompt, BlendSettings(ratio=1.0)), 5, keep_logits=True)
    assert blended.token_ids == full.token_ids
    for a, b in zip(blended.logits, full.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_prefix_baseline_reuses_system_and_history_exactly(engine: BlendEngine, smol_prompt: Prompt) -> None:
    full = engine.full(smol_prompt)
    prefix = engine.prefix(smol_prompt)
    assert prefix.exact_prefix_tokens == len(smol_prompt.segments[0]) + len(smol_prompt.segments[1])
    assert prefix.token_layers == (len(smol_prompt) - prefix.exact_prefix_tokens) * prefix.num_layers
    torch.testing.assert_close(prefix.logits, full.logits, atol=1e-4, rtol=1e-4)
