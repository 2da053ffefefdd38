"""Fixtures for the blend tests: a small real prompt (SmolLM2 itself comes from tests/conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kvshard.segments import Prompt, Segment, SegmentKind


@pytest.fixture(scope="session")
def smol_prompt(smollm2: Any) -> Prompt:
    """A small real recommendation-shaped prompt (about 90 tokens)."""
    tok = smollm2.tokenizer

    def seg(kind: SegmentKind, text: str) -> Segment:
        return Segment(kind, tuple(tok.encode(text, add_special_tokens=False)), text)

    return Prompt.of([
        seg(SegmentKind.SYSTEM, "<|im_start|>system\nYou recommend movies.<|im_end|>\n<|im_start|>user\n"
                                "Movies this user watched:\n"),
        seg(SegmentKind.HISTORY, "- Toy Story (1995)\n- Heat (1995)\n- Babe (1995)\n"),
        seg(SegmentKind.FREE, "\nCandidates:\n"),
        seg(SegmentKind.FREE, "A. "), seg(SegmentKind.ITEM, "Casino (1995)\n"),
        seg(SegmentKind.FREE, "B. "), seg(SegmentKind.ITEM, "Jumanji (1995)\n"),
        seg(SegmentKind.FREE, "C. "), seg(SegmentKind.ITEM, "Sabrina (1995)\n"),
        seg(SegmentKind.INSTRUCTION, "\nWhich candidate next? Answer with its letter only.<|im_end|>\n"
                                     "<|im_start|>assistant\n"),
    ])
