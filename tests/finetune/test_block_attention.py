"""Fine-tuning's training forward computes what the dense block mask computes: the block attention, blocks
cut after their label openings, and a late scorer's item bodies read from the frozen layers' cache give the
same isolated and late scores and the same gradients (float32: only summation order differs), for prompts of
different lengths in one pass, and the model keeps its own attention outside the call."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvshard.prompt_template import PromptTemplate
from kvshard.prompts import PromptBuilder, RecommendationRequest
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, batched_isolated_scores, readout_id
from kvshard_training.block_attention import BlockLayout, block_scores
from kvshard_training.frozen_bodies import FrozenBodies, body_of


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


def scores_and_gradient(model: Any, scorer: Any, inputs: list[IsolatedInputs],
                        layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores, and the gradient at ``layer``'s key projection (the first: every path of the pass), the only
    trainable tensor: the layers below it are frozen."""
    probe = model.model.model.layers[layer].self_attn.k_proj.weight
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


def test_cutting_blocks_at_their_openings_keeps_every_scored_row_where_it_stood() -> None:
    whole = IsolatedInputs(tuple(range(20)), ((4, 10), (10, 15), (15, 20)), (7, 12, 17), 2)
    cut = whole.ending_at_openings()
    assert cut.blocks == ((4, 8), (8, 11), (11, 14)) and cut.readouts == (7, 10, 13)
    assert cut.token_ids == (0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 15, 16, 17)
    kept = [0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 15, 16, 17]
    assert cut.positions().tolist() == whole.positions()[kept].tolist()
    assert [cut.token_ids[r] for r in cut.readers()] == [whole.token_ids[r] for r in whole.readers()]


@pytest.mark.model
@pytest.mark.parametrize("interaction", [None, 4], ids=["isolated", "late-4"])
def test_blocks_cut_at_their_openings_give_the_same_scores(float32_model: Any, movielens: Any,
                                                           interaction: int | None) -> None:
    whole = prompts(float32_model, movielens, interaction)
    cut = [p.ending_at_openings() for p in whole]
    assert sum(len(p.token_ids) for p in cut) < sum(len(p.token_ids) for p in whole)
    reference, reference_gradient = scores_and_gradient(float32_model, block_scores, whole)
    scores, gradient = scores_and_gradient(float32_model, block_scores, cut)
    assert torch.allclose(scores, reference, atol=1e-4)
    assert torch.allclose(gradient, reference_gradient, atol=1e-5, rtol=1e-3)


@pytest.mark.model
@pytest.mark.parametrize("interaction", [0, 4], ids=["late-0", "late-4"])
def test_item_bodies_from_the_frozen_layers_give_the_same_scores_and_gradients(float32_model: Any, movielens: Any,
                                                                               interaction: int) -> None:
    """Layers below the trainable one are frozen: each body is computed there once, alone, and every
    prompt reads it — the scores and gradients the whole rows gave, again when the cache evicts."""
    inputs = [p.ending_at_openings() for p in prompts(float32_model, movielens, interaction)]
    reference, reference_gradient = scores_and_gradient(float32_model, block_scores, inputs, layer=20)
    bodies = FrozenBodies(float32_model.model, capacity=1 << 30)
    for _ in range(2):  # computed, then read from the cache
        scores, gradient = scores_and_gradient(float32_model, lambda _, p, r: bodies.scores(p, r), inputs, layer=20)
        assert torch.allclose(scores, reference, atol=1e-4)
        assert torch.allclose(gradient, reference_gradient, atol=1e-5, rtol=1e-3)
    assert bodies.frozen == 20 and bodies.hits == bodies.misses == len(bodies.bodies) > 0
    small = FrozenBodies(float32_model.model, capacity=1)
    scores, _ = scores_and_gradient(float32_model, lambda _, p, r: small.scores(p, r), inputs, layer=20)
    assert torch.allclose(scores, reference, atol=1e-4)
    assert len(small.bodies) == len({body_of(p, b) for p in inputs for b in range(len(p.blocks))})
