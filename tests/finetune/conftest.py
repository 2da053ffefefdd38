"""A tiny real fine-tuning run (2 steps on a handful of MovieLens users), shared by the training and merge tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshard_training.settings import FinetuneSettings


def tiny_settings(out: Path) -> FinetuneSettings:
    """What `make test` trains: 5 users, 3 history items, 4 candidates, LoRA rank 2 on the top 2 layers, each
    request under two candidate orders with the agreement term and the pointwise term on."""
    return FinetuneSettings(out=out, history=3, candidates=4, steps=2, accumulation=1, users=5, val_users=2,
                            rank=2, alpha=4, layers=2, targets=("q_proj", "v_proj", "down_proj"), warmup=1,
                            minutes=5.0, consistency=1.0, pointwise=1.0)


@pytest.fixture(scope="session")
def tiny_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Trained through the CLI, with the very command line the provenance records."""
    from kvshard.cli import main
    from kvshard_sidecar.engine.model import default_model_path

    if not (default_model_path() / "config.json").exists():
        pytest.fail(f"SmolLM2 is not prepared at {default_model_path()}: run `kvshard model prepare`")
    out = tmp_path_factory.mktemp("adapter")
    assert main(tiny_settings(out).command().split()[1:]) == 0
    return out
