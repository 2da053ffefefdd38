"""Fine-tuning's block attention computes what the dense block mask computes: the same isolated and late
scores and the same gradients (float32: only summation order differs), for prompts of different lengths in
one pass, and the model keeps its own attention outside the call."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvshard.prompt_template import PromptTemplate
from kvshard.prompts import PromptBuilder, RecommendationRequest
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, batched_isolated_scores, readout_id
from kvshard_training.block_attention import BlockLayout, block_scores


@pytest.fixture(scope="module")
def float32_model() -> Any:
    from kvshard_sidecar.engine.model import load_model

    return load_model(dtype="float32")


def prompts(model: Any, movielens: Any, interaction: int | None) -> list[IsolatedInputs]:
    """Three requests with different histories and candidate counts: different prefixes, blocks and lengths."""
    builder = PromptBuilder(model.tokenizer, movielens, template=PromptTemplate(label_position="after"))
    users = [(u, h) for u, h in sorted(movielens.histories.items()) if len(h) > 20][:3]
    requests = []
    for (user, history), (length, candidates) in zip(users, [(3, 5), (7, 4), (5, 6)], strict=True):
        unseen = [item for item in sorted(movielens.items) if item not in set(history)][:candidates - 1]
        requests.append(RecommendationRequest(user, list(history[:length]), [history[length], *unseen]))
    return [IsolatedInputs.of(builder.build(r), interaction) for r in requests]


def scores_and_gradient(model: Any, scorer: Any, inputs: list[IsolatedInputs]) -> tuple[torch.Tensor, torch.Tensor]:
    probe = model.model.model.layers[0].self_attn.k_proj.weight  # the first layer: every path of the pass
    for parameter in model.model.parameters():
        parameter.requires_grad_(parameter is probe)
    scores = torch.cat(scorer(model.model, inputs, readout_id(model.tokenizer)))
    (gradient,) = torch.autograd.grad((scores * torch.linspace(-1, 1, len(scores))).sum(), probe)
    return scores.detach(), gradient


@pytest.mark.model
@pytest.mark.parametrize("interaction", [None, 0, 4], ids=["isolated", "late-0", "late-4"])
def test_block_attention_gives_the_dense_masks_scores_and_gradients(float32_model: Any, movielens: Any,
                                                                   interaction: int | None) -> None:
    inputs = prompts(float32_model, movielens, interaction)
    assert len({len(p.token_ids) for p in inputs}) == 3 and len({p.prefix for p in inputs}) == 3
    dense, dense_gradient = scores_and_gradient(float32_model, batched_isolated_scores, inputs)
    block, block_gradient = scores_and_gradient(float32_model, block_scores, inputs)
    assert torch.allclose(block, dense, atol=1e-4)
    assert torch.allclose(block_gradient, dense_gradient, atol=1e-5, rtol=1e-3)
    assert float(block_gradient.abs().max()) > 0


@pytest.mark.model
def test_a_late_scorers_item_rows_do_not_read_the_history_and_an_isolated_scorers_do(float32_model: Any,
                                                                                     movielens: Any) -> None:
    """The two scorers differ only in the mask: the block path must not blur them into one."""
    late = torch.cat(block_scores(float32_model.model, prompts(float32_model, movielens, 0), 0))
    isolated = torch.cat(block_scores(float32_model.model, prompts(float32_model, movielens, None), 0))
    assert not torch.allclose(late, isolated, atol=1e-3)


@pytest.mark.model
def test_the_model_keeps_its_own_attention_outside_the_call(float32_model: Any, movielens: Any) -> None:
    before = float32_model.model.config._attn_implementation
    inputs = prompts(float32_model, movielens, 4)
    with torch.no_grad():
        block_scores(float32_model.model, inputs, 0)
    assert float32_model.model.config._attn_implementation == before
    gap = inputs[0].blocks[:1] + inputs[0].blocks[2:]  # a candidate's rows no block covers
    broken = IsolatedInputs(inputs[0].token_ids, gap, inputs[0].readouts[:1] + inputs[0].readouts[2:], 4)
    with pytest.raises(ValueError, match="tile the prompt"), torch.no_grad():
        block_scores(float32_model.model, [broken], 0)
    assert float32_model.model.config._attn_implementation == before


def test_the_layout_refuses_blocks_that_do_not_tile_the_prompt() -> None:
    """A gap between the prefix and the first block, or tokens after the last: the dense mask would let
    them be read; the block attention has no row for them."""
    tiled = IsolatedInputs(tuple(range(10)), ((4, 7), (7, 10)), (6, 9), 0)
    assert BlockLayout.of([tiled], 10).gather.tolist()[:4] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="tile the prompt"):
        BlockLayout.of([IsolatedInputs(tuple(range(11)), ((4, 7), (7, 10)), (6, 9), 0)], 11)
    with pytest.raises(ValueError, match="tile the prompt"):
        BlockLayout.of([IsolatedInputs(tuple(range(10)), ((4, 6), (7, 10)), (5, 9), 0)], 10)
