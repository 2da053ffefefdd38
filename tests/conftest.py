"""Fixtures shared by every test folder: the real SmolLM2 model, loaded once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm2() -> Iterator[Any]:
    """The prepared SmolLM2-135M-Instruct (``make test`` prepares it; see ``kvshard model prepare``)."""
    from kvshard_sidecar.model import default_model_path, load_model

    if not (default_model_path() / "config.json").exists():
        pytest.fail(f"SmolLM2 is not prepared at {default_model_path()}: run `kvshard model prepare`")
    yield load_model()


@pytest.fixture(scope="session")
def movielens() -> Any:
    from kvshard.datasets import load_dataset

    return load_dataset("movielens-100k")


@pytest.fixture
def tiny_dataset_dir(tmp_path: Path) -> Path:
    """A user-format dataset folder with three items and two users."""
    (tmp_path / "items.jsonl").write_text(
        '{"id": "a", "text": "Alpha (2001), Drama"}\n'
        '{"id": "b", "text": "Beta (2002), Comedy"}\n'
        '{"id": 3, "text": "Gamma   (2003),\\n Horror"}\n'
    )
    (tmp_path / "interactions.jsonl").write_text(
        '{"user": "u1", "item": "b", "timestamp": 20}\n'
        '{"user": "u1", "item": "a", "timestamp": 10}\n'
        '{"user": "u2", "item": "3", "timestamp": 5}\n'
    )
    return tmp_path
