"""Block keys name a segment's KV everywhere: stable across processes, sensitive to what matters."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvshard.segments import ModelIdentity, Segment, SegmentKind, block_key, is_block_key

IDENTITY = ModelIdentity(name="SmolLM2-135M-Instruct", revision="abc123", tokenizer="tok456")
SEGMENT = Segment(SegmentKind.ITEM, (1, 2, 3, 49152))

_KEY_IN_CHILD = (
    "from kvshard.segments import *;"
    "print(block_key(ModelIdentity('SmolLM2-135M-Instruct','abc123','tok456'),"
    " Segment(SegmentKind.ITEM,(1,2,3,49152))))"
)


def test_keys_are_identical_across_processes_with_different_hash_seeds() -> None:
    keys = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _KEY_IN_CHILD], env=env, check=True,
                             capture_output=True, text=True)
        keys.add(out.stdout.strip())
    assert keys == {block_key(IDENTITY, SEGMENT)}


def test_key_is_64_hex_characters() -> None:
    assert is_block_key(block_key(IDENTITY, SEGMENT))
    assert not is_block_key("../etc/passwd")


@pytest.mark.parametrize(
    "other",
    [
        ModelIdentity("SmolLM2-360M-Instruct", "abc123", "tok456"),
        ModelIdentity("SmolLM2-135M-Instruct", "abc124", "tok456"),
        ModelIdentity("SmolLM2-135M-Instruct", "abc123", "tok457"),
        ModelIdentity("SmolLM2-135M-Instruct", "abc123", "tok456", dtype="bfloat16"),
    ],
)
def test_key_changes_with_model_identity(other: ModelIdentity) -> None:
    assert block_key(other, SEGMENT) != block_key(IDENTITY, SEGMENT)


def test_key_changes_with_kind_and_prefill_context() -> None:
    history = Segment(SegmentKind.HISTORY, SEGMENT.token_ids)
    assert block_key(IDENTITY, history) != block_key(IDENTITY, SEGMENT)
    assert block_key(IDENTITY, SEGMENT, context="behind-system") != block_key(IDENTITY, SEGMENT)


def test_key_ignores_display_text() -> None:
    assert block_key(IDENTITY, Segment(SegmentKind.ITEM, SEGMENT.token_ids, "shown")) == block_key(IDENTITY, SEGMENT)


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64), st.data())
def test_key_changes_when_any_token_changes(tokens: list[int], data: st.DataObject) -> None:
    index = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[index] = (changed[index] + data.draw(st.integers(1, 2**32 - 1))) % 2**32
    original = Segment(SegmentKind.ITEM, tuple(tokens))
    assert block_key(IDENTITY, Segment(SegmentKind.ITEM, tuple(changed))) != block_key(IDENTITY, original)


def test_key_distinguishes_token_boundaries() -> None:
    # (1, 2) + (3,) and (1,) + (2, 3) differ in the segment, so their keys must too.
    pair, single = Segment(SegmentKind.ITEM, (1, 2)), Segment(SegmentKind.ITEM, (1,))
    assert block_key(IDENTITY, pair) != block_key(IDENTITY, single)


def test_segments_refuse_empty_or_out_of_range_tokens() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        Segment(SegmentKind.ITEM, ())
    with pytest.raises(ValueError, match="token ids"):
        Segment(SegmentKind.ITEM, (-1,))
