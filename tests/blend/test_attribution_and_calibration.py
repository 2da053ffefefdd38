"""Oracle rows and the attention calibration: the measurement tools behave as their definitions say."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from blend_helpers import TINY_IDENTITY, tiny_model

from kvshard.segments import ModelIdentity, Prompt, Segment, SegmentKind
from kvshard_sidecar.engine import BlendEngine, BlendSettings
from kvshard_sidecar.engine.calibration import (
    CalibrationError,
    calibrate,
    load_calibration,
    save_calibration,
)
from kvshard_sidecar.engine.oracle import Oracle, part_rows


def list_prompt(seed: int = 1) -> Prompt:
    generator = torch.Generator().manual_seed(seed)
    kinds = [SegmentKind.SYSTEM, SegmentKind.HISTORY, SegmentKind.FREE]
    kinds += [SegmentKind.FREE, SegmentKind.ITEM] * 3 + [SegmentKind.INSTRUCTION]
    sizes = (6, 9, 3, 3, 5, 3, 7, 3, 6, 4)
    return Prompt.of(Segment(kind, tuple(torch.randint(3, 97, (n,), generator=generator).tolist()))
                     for kind, n in zip(kinds, sizes, strict=True))


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    return BlendEngine(tiny_model("llama", seed=3), TINY_IDENTITY)


def test_part_rows_name_the_prompts_pieces() -> None:
    prompt = list_prompt()
    spans = prompt.spans
    header = part_rows(prompt, ["header"])
    assert torch.nonzero(header).reshape(-1).tolist() == list(range(spans[2].start, spans[2].end))
    dots = torch.nonzero(part_rows(prompt, ["label_dot"])).reshape(-1).tolist()
    assert dots == [spans[i].start + 1 for i in (3, 5, 7)]
    labels = part_rows(prompt, ["labels"])
    assert torch.equal(labels, part_rows(prompt, ["label_letter", "label_dot", "label_space"]))
    everything = part_rows(prompt, ["system", "history", "header", "labels", "items", "instruction"])
    assert bool(everything.all())
    with pytest.raises(ValueError, match="unknown"):
        part_rows(prompt, ["footer"])


def test_part_rows_find_the_letter_of_a_label_after_its_item() -> None:
    """``<item> [A]\n``: the letter is a label's second token, ``"]"`` and the newline its punctuation."""
    generator = torch.Generator().manual_seed(2)
    kinds = [SegmentKind.SYSTEM, SegmentKind.HISTORY, SegmentKind.FREE]
    kinds += [SegmentKind.ITEM, SegmentKind.FREE] * 3 + [SegmentKind.INSTRUCTION]
    sizes = (6, 9, 3, 5, 4, 7, 4, 6, 4, 4)
    prompt = Prompt.of(Segment(kind, tuple(torch.randint(3, 97, (n,), generator=generator).tolist()))
                       for kind, n in zip(kinds, sizes, strict=True))
    spans = prompt.spans
    letters = torch.nonzero(part_rows(prompt, ["label_letter"])).reshape(-1).tolist()
    assert letters == [spans[i].start + 1 for i in (4, 6, 8)]
    dots = torch.nonzero(part_rows(prompt, ["label_dot"])).reshape(-1).tolist()
    assert dots == [row for i in (4, 6, 8) for row in (spans[i].start + 2, spans[i].start + 3)]
    assert torch.equal(part_rows(prompt, ["labels"]), part_rows(prompt, ["label_letter", "label_dot", "label_space"]))


def test_every_oracle_row_exact_is_full_prefill_and_none_is_not(engine: BlendEngine) -> None:
    prompt = list_prompt()
    full = engine.full(prompt)
    stale = BlendSettings(selector="none", prefill_context="standalone")
    everything = Oracle(full.kv, torch.ones(len(prompt), dtype=torch.bool))
    torch.testing.assert_close(engine.blend(prompt, stale, oracle=everything).logits, full.logits,
                               atol=1e-5, rtol=1e-5)
    nothing = Oracle(full.kv, torch.zeros(len(prompt), dtype=torch.bool))
    assert float((engine.blend(prompt, stale, oracle=nothing).logits - full.logits).abs().max()) > 1e-3


def test_layer_oracle_copies_only_layers_up_to_l(engine: BlendEngine) -> None:
    prompt = list_prompt()
    full = engine.full(prompt)
    blended = engine.blend(prompt, BlendSettings(selector="none", prefill_context="standalone"))
    kv = blended.kv
    before = kv.keys.clone()
    with torch.inference_mode():  # blend() applies oracles inside its inference mode; so does this test
        Oracle(full.kv, torch.ones(len(prompt), dtype=torch.bool), upto_layer=0).apply(kv)
    torch.testing.assert_close(kv.keys[0], full.kv.keys[0])
    assert torch.equal(kv.keys[1:], before[1:])


def test_calibration_is_deterministic_and_stored_beside_the_model(engine: BlendEngine, tmp_path: Path) -> None:
    prompts = [(list_prompt(seed), [3, 4, 5, 6]) for seed in (1, 2)]
    base = BlendSettings(prefill_context="standalone")
    grid = {"temperatures": (1.0, 1.5), "scales": (0.5, 1.0)}
    first = calibrate(engine, prompts, base, {"users": ["u1"]}, **grid)
    second = calibrate(engine, prompts, base, {"users": ["u1"]}, **grid)
    assert first == second
    scores = {(p["temperature"], p["scale"]): p["score"] for p in first.provenance["grid"]}
    assert scores[(first.temperature, first.scale)] == min(scores.values())
    save_calibration(first, tmp_path)
    assert load_calibration(tmp_path, TINY_IDENTITY) == first


def test_a_calibration_of_another_model_is_refused(engine: BlendEngine, tmp_path: Path) -> None:
    calibration = calibrate(engine, [(list_prompt(), [3, 4])], BlendSettings(), temperatures=(1.0,), scales=(1.0,))
    save_calibration(calibration, tmp_path)
    other = ModelIdentity("tiny", "other-weights", TINY_IDENTITY.tokenizer)
    with pytest.raises(CalibrationError, match="not the loaded"):
        load_calibration(tmp_path, other)
    with pytest.raises(CalibrationError, match="no calibration"):
        load_calibration(tmp_path / "missing", TINY_IDENTITY)
