"""Fixtures shared by every test folder: the real SmolLM2 model, MovieLens, and real etcd servers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvshard_local.testing_servers import EtcdNotInstalledError, EtcdServer


def _running_etcd() -> Iterator[EtcdServer]:
    """A fresh etcd; without the binary the test skips locally but fails in CI, where the Makefile
    installs it, so a missing install step can never pass as a skip."""
    try:
        server = EtcdServer()
    except EtcdNotInstalledError as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    with server:
        yield server


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    """A real etcd for one test (stop()/start() it to simulate an outage)."""
    yield from _running_etcd()


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    """A real etcd shared by the tests of one module."""
    yield from _running_etcd()


@pytest.fixture(scope="session")
def smollm2() -> Iterator[Any]:
    """The prepared SmolLM2-135M-Instruct (``make test`` prepares it; see ``kvshard model prepare``)."""
    from kvshard_sidecar.engine.model import default_model_path, load_model

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
