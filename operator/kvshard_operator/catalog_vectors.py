"""Bring-your-own item vectors: a catalog that carries embeddings skips the model (issue 19).

Recommender teams usually have item vectors already (a two-tower model's item tower), and the
numpy MiniLM embeds ~117 items/s here: a million items would wait hours for a placement they can
have in seconds. ``spec.catalog.embeddings`` says where the vectors are:

* ``from: Model`` (default) — the operator embeds the texts (:mod:`embedding`);
* ``from: Field`` — every JSONL line carries its vector in ``field`` (default ``embedding``),
  read in the same pass as the line (:class:`LineVectors` is :func:`parse_jsonl`'s ``extra`` hook);
* ``from: File`` — a side file ``.npz`` with ``ids`` and ``vectors`` arrays, keyed by id (the
  shape two-tower exports have), on a volume the operator mounts.

Vectors are checked like lines are: the right dimension (``dimension`` or, without it, the first
line's), finite, not zero. A catalog where some lines have vectors and others do not is refused,
naming those lines — placing half a catalog by one geometry and half by another is never what was
meant. Vectors are kept unit-length float16 (half the memory; cosine is all placement needs).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvshard.catalog_schema import Catalog, CatalogError, parse_jsonl
from kvshard_operator import catalog as catalogs
from kvshard_operator.vectors import unit

HalfArray = npt.NDArray[np.float16]

MODEL, FIELD, FILE = "Model", "Field", "File"
MAX_DIMENSION = 4096


@dataclasses.dataclass(frozen=True)
class VectorSpec:
    """``spec.catalog.embeddings``: where the item vectors come from."""

    source: str = MODEL
    field: str = "embedding"
    path: str | None = None
    dimension: int | None = None

    @classmethod
    def of(cls, catalog_spec: Mapping[str, Any]) -> VectorSpec:
        doc = catalog_spec.get("embeddings") or {}
        return cls(str(doc.get("from", MODEL)), str(doc.get("field", "embedding")),
                   (doc.get("file") or {}).get("path"), doc.get("dimension"))


class LineVectors:
    """Collects each line's vector for :func:`parse_jsonl` and says why a line's vector is bad."""

    def __init__(self, field: str, dimension: int | None = None) -> None:
        self.field = field
        self.dimension = dimension
        self.rows: list[npt.NDArray[np.float32]] = []

    def __call__(self, row: Any) -> str | None:
        value = row.get(self.field) if isinstance(row, dict) else None
        if value is None:
            return (f"no {self.field!r} vector (spec.catalog.embeddings.from is Field: every line needs one; "
                    "a catalog with vectors on some lines only is refused)")
        vector = as_vector(value, self.dimension, self.field)
        if isinstance(vector, str):
            return vector
        self.dimension = len(vector)
        self.rows.append(vector)
        return None

    def matrix(self) -> HalfArray:
        dim = self.dimension or 0
        out = np.empty((len(self.rows), dim), dtype=np.float16)
        for start in range(0, len(self.rows), 65536):
            out[start:start + 65536] = unit(np.stack(self.rows[start:start + 65536]).reshape(-1, dim))
        return out


def as_vector(value: Any, dimension: int | None, field: str = "embedding") -> npt.NDArray[np.float32] | str:
    """``value`` as a float32 vector, or why it is not a usable one (checked in numpy: a million
    lines of 384 numbers each must not be looped over in Python)."""
    if not isinstance(value, list) or not value:
        return f"field {field!r} must be a non-empty list of numbers"
    try:
        raw = np.asarray(value)
    except ValueError:  # ragged nesting
        return f"field {field!r} must hold only numbers"
    if raw.ndim != 1 or raw.dtype.kind not in "fi":  # strings, booleans, nulls, lists give other kinds
        return f"field {field!r} must hold only numbers"
    with np.errstate(over="ignore"):
        vector = raw.astype(np.float32)
    if dimension is not None and len(vector) != dimension:
        return f"field {field!r} has {len(vector)} dimensions, expected {dimension}"
    if len(vector) > MAX_DIMENSION:
        return f"field {field!r} has more than {MAX_DIMENSION} dimensions"
    if not np.isfinite(vector).all():
        return f"field {field!r} holds a NaN or an infinity (or a number too large for float32)"
    if not vector.any():
        return f"field {field!r} is the zero vector (it has no direction)"
    return vector


def parse_with_vectors(text: str, origin: str, spec: VectorSpec) -> tuple[Catalog, HalfArray]:
    """The catalog and its vectors (one row per item, catalog order) from JSONL lines carrying them."""
    collect = LineVectors(spec.field, spec.dimension)
    catalog = parse_jsonl(text, origin, collect)
    return catalog, collect.matrix()


def read_side_file(path: Path, catalog: Catalog, dimension: int | None = None) -> HalfArray:
    """Vectors for ``catalog`` from an ``.npz`` of ``ids`` (strings) and ``vectors`` (2-D floats),
    reordered to the catalog; every catalog item must be there (extra ids are ignored)."""
    origin = f"vector file {path}"
    try:
        with np.load(path, allow_pickle=False) as doc:
            ids = [str(i) for i in doc["ids"]]
            vectors = doc["vectors"]
    except (OSError, KeyError, ValueError) as exc:
        raise CatalogError("EmbeddingsInvalid", f"{origin}: {exc} (expected an .npz with 'ids' and 'vectors')") \
            from exc
    if vectors.ndim != 2 or len(vectors) != len(ids) or not np.issubdtype(vectors.dtype, np.floating):
        raise CatalogError("EmbeddingsInvalid", f"{origin}: 'vectors' must be a float matrix with one row per id, "
                           f"got {vectors.dtype} {vectors.shape} for {len(ids)} ids")
    if dimension is not None and vectors.shape[1] != dimension:
        raise CatalogError("EmbeddingsInvalid", f"{origin}: vectors have {vectors.shape[1]} dimensions, "
                           f"expected {dimension}")
    row = {item: i for i, item in enumerate(ids)}
    missing = [(n, item) for n, item in enumerate(catalog.ids, start=1) if item not in row]
    if missing:
        named = ", ".join(f"item {item!r} (catalog item {n})" for n, item in missing[:5])
        raise CatalogError("EmbeddingsInvalid", f"{origin}: {len(missing)} catalog item(s) have no vector: {named}",
                           [f"item {n}: {item!r} has no vector" for n, item in missing[:5]])
    order = np.fromiter((row[item] for item in catalog.ids), dtype=np.int64, count=len(catalog))
    out = np.empty((len(order), vectors.shape[1]), dtype=np.float16)
    for start in range(0, len(order), 65536):
        chunk = np.asarray(vectors[order[start:start + 65536]], dtype=np.float32)
        bad = np.flatnonzero(~np.isfinite(chunk).all(axis=1) | ~chunk.any(axis=1))
        if len(bad):
            items = [catalog.ids[start + int(b)] for b in bad[:5]]
            raise CatalogError("EmbeddingsInvalid", f"{origin}: {len(bad)}+ vector(s) are not finite or zero, "
                               f"e.g. {', '.join(map(repr, items))}")
        out[start:start + 65536] = unit(chunk)
    return out


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A catalog and, when ``spec.catalog.embeddings`` gives them, its vectors (row ``i`` is item ``i``).

    ``vectors`` is None for ``from: Model`` (the operator embeds the texts). A vector is not part of
    the catalog's version (the line's field is dropped): an item whose text is unchanged is an
    unchanged item and keeps its cluster, whatever its new vector says, until the next full
    clustering (``spec.clusters`` changes) — the same rule as for model embeddings."""

    catalog: Catalog
    vectors: HalfArray | None = None

    @property
    def digest(self) -> str:
        """Content hash of the vectors ("" without): part of the clustering's cache key."""
        if self.vectors is None:
            return ""
        return hashlib.blake2b(np.ascontiguousarray(self.vectors).data, digest_size=16).hexdigest()


def load(source: Mapping[str, Any], namespace: str, read_configmap: catalogs.ConfigMapReader | None = None,
         read_secret_key: catalogs.SecretKeyReader | None = None) -> Loaded:
    """``spec.catalog`` read as :func:`catalog.load_catalog` reads it, plus the vectors its
    ``embeddings`` names; every vector problem is a :class:`CatalogError` (``EmbeddingsInvalid``
    for a bad side file, ``CatalogInvalid`` with the line numbers for bad or missing line vectors),
    so it ends in the CacheShard's conditions like any other catalog error."""
    spec = VectorSpec.of(source)
    if spec.source == FIELD:
        collect = LineVectors(spec.field, spec.dimension)
        catalog = catalogs.load_catalog(source, namespace, read_configmap, read_secret_key, collect)
        return Loaded(catalog, collect.matrix())
    catalog = catalogs.load_catalog(source, namespace, read_configmap, read_secret_key)
    if spec.source == FILE:
        if not spec.path:
            raise CatalogError("EmbeddingsInvalid", "spec.catalog.embeddings.file.path is required when from is File")
        return Loaded(catalog, read_side_file(Path(spec.path), catalog, spec.dimension))
    return Loaded(catalog)
