"""The numpy MiniLM matches sentence-transformers, and catalog embeddings are cached by content."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvshard_operator import embedding

TEXTS = [
    "Toy Story (1995) | Animation, Children's, Comedy",
    "GoldenEye (1995) | Action, Adventure, Thriller",
    "x",
    "A much longer description of an item that goes on and on " * 8,
]


@pytest.mark.slow
def test_numpy_forward_matches_sentence_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(str(embedding.model_dir()), device="cpu").encode(
        TEXTS, normalize_embeddings=True
    )
    ours = embedding.MiniLM().encode(TEXTS)
    assert ours.shape == (4, embedding.DIMENSION)
    assert np.abs(ours - reference).max() < 1e-4


def test_similar_items_are_closer_than_unrelated_ones() -> None:
    v = embedding.MiniLM().encode(["space adventure with aliens", "aliens invade a space station", "a cooking show"])
    assert v[0] @ v[1] > v[0] @ v[2]
    assert np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-5)


def test_catalog_embeddings_are_cached_by_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ids, texts = ["a", "b"], ["first item", "second item"]
    first = embedding.embed_catalog(ids, texts, cache=tmp_path)
    files = list((tmp_path / "embeddings").glob("*.npy"))
    assert len(files) == 1

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached catalog must not be embedded again")

    monkeypatch.setattr(embedding.MiniLM, "encode", refuse)
    assert np.array_equal(embedding.embed_catalog(ids, texts, cache=tmp_path), first)
    monkeypatch.undo()
    embedding.embed_catalog(ids, ["first item", "changed"], cache=tmp_path)
    assert len(list((tmp_path / "embeddings").glob("*.npy"))) == 2
