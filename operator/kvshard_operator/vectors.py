"""Item vectors read a chunk at a time, so a catalog of millions never sits in memory as float32.

10 M items × 384 dimensions is 15.4 GB as float32 — more than an operator pod should hold, and
twice that while numpy makes a normalised copy. Placement (:mod:`placement_large`) therefore never
asks for the whole matrix: it reads a sample once (to train centroids) and then the rows in
chunks (to assign them). A :class:`VectorSource` gives exactly those two operations, each
returning unit-length float32 rows of just the requested size:

* :class:`ArrayVectors` wraps an array already in memory — float16 (half the bytes) or a
  ``np.memmap`` — and converts only the requested rows;
* :class:`NpyVectors` reads a ``.npy`` file (float16 or float32) with positional reads instead of
  a memory map: the pages go through the kernel's page cache, which is shared and reclaimable,
  not into the operator's resident set, so the operator's peak memory does not grow with the file.

:func:`write_npy` streams chunks into such a file (header first, then rows), which is how the
embedding workers and the bench produce them without holding the matrix either.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]
IndexArray = npt.NDArray[np.int64]

_DTYPES = {np.dtype("<f2"), np.dtype("<f4")}


class VectorSource(Protocol):
    """Rows of item vectors, in catalog order, read on demand as unit float32."""

    @property
    def rows(self) -> int: ...

    @property
    def dim(self) -> int: ...

    def read(self, start: int, stop: int) -> FloatArray:
        """Rows ``start:stop``, unit length, float32 (a new array)."""
        ...

    def take(self, rows: IndexArray) -> FloatArray:
        """The given rows (sorted or not), unit length, float32 (a new array)."""
        ...


def unit(x: npt.NDArray[np.floating]) -> FloatArray:
    """float32 rows scaled to unit length (zero rows stay zero); converts, never keeps ``x``."""
    out = np.array(x, dtype=np.float32, copy=True)  # never a view: memmaps and callers' arrays stay as they are
    scale = np.einsum("ij,ij->i", out, out)
    np.sqrt(scale, out=scale)
    np.maximum(scale, 1e-12, out=scale)
    np.divide(1.0, scale, out=scale)
    out *= scale[:, None]
    return out


class ArrayVectors:
    """An in-memory (or memory-mapped) matrix of any float dtype."""

    def __init__(self, matrix: npt.NDArray[np.floating]) -> None:
        if matrix.ndim != 2:
            raise ValueError("vectors must be a 2-D matrix")
        self.matrix = matrix

    @property
    def rows(self) -> int:
        return int(self.matrix.shape[0])

    @property
    def dim(self) -> int:
        return int(self.matrix.shape[1])

    def read(self, start: int, stop: int) -> FloatArray:
        return unit(self.matrix[start:stop])

    def take(self, rows: IndexArray) -> FloatArray:
        return unit(self.matrix[np.asarray(rows, dtype=np.int64)])


class NpyVectors:
    """A ``.npy`` matrix (float16 or float32, C order) read with ``pread``, never mapped."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        fmt: Any = np.lib.format  # numpy ships this module untyped
        with self.path.open("rb") as f:
            major, _minor = fmt.read_magic(f)
            if major == 1:
                shape, fortran, dtype = fmt.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = fmt.read_array_header_2_0(f)
            self.offset = f.tell()
        if fortran or len(shape) != 2 or dtype not in _DTYPES:
            raise ValueError(f"{path}: expected a C-order 2-D float16/float32 matrix, got {dtype} {shape}")
        self.dtype: np.dtype[np.floating] = dtype
        self.shape: tuple[int, int] = (int(shape[0]), int(shape[1]))
        self.row_bytes = self.shape[1] * dtype.itemsize

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def dim(self) -> int:
        return self.shape[1]

    def _read_into(self, fd: int, buffer: memoryview, row: int) -> None:
        """Fill ``buffer`` (whole rows) from the file, starting at ``row``."""
        offset = self.offset + row * self.row_bytes
        while len(buffer):
            got = os.preadv(fd, [buffer], offset)
            if got <= 0:
                raise ValueError(f"{self.path}: short read at byte {offset}")
            buffer, offset = buffer[got:], offset + got

    def read(self, start: int, stop: int) -> FloatArray:
        start, stop = max(0, start), max(start, min(stop, self.rows))
        raw = np.empty((max(0, stop - start), self.dim), dtype=self.dtype)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            self._read_into(fd, raw.reshape(-1).view(np.uint8).data, start)
        finally:
            os.close(fd)
        return unit(raw)

    def take(self, rows: IndexArray) -> FloatArray:
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.rows):
            raise IndexError(f"{self.path}: rows outside 0..{self.rows - 1}")
        if not len(rows):
            return np.empty((0, self.dim), dtype=np.float32)
        order = np.argsort(rows, kind="stable")
        wanted = rows[order]
        # neighbouring rows are read together: a sorted sample of a big file is mostly single rows,
        # a catalog's leftovers are often runs
        cuts = np.flatnonzero(np.diff(wanted) != 1) + 1
        firsts = [0, *cuts.tolist()]
        raw = np.empty((len(rows), self.dim), dtype=self.dtype)
        view = raw.reshape(-1).view(np.uint8).data
        size = self.row_bytes
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for a, b, row in zip(firsts, [*cuts.tolist(), len(rows)], wanted[firsts].tolist(), strict=True):
                self._read_into(fd, view[a * size:b * size], row)
        finally:
            os.close(fd)
        out = np.empty_like(raw)
        out[order] = raw
        return unit(out)


def write_npy(path: Path, chunks: Iterable[npt.NDArray[np.floating]], rows: int, dim: int,
              dtype: npt.DTypeLike = np.float16) -> Path:
    """Stream ``chunks`` (2-D, ``dim`` columns, ``rows`` in all) into a ``.npy`` file of ``dtype``,
    written to a temporary name and renamed, so a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    written = 0
    fmt: Any = np.lib.format  # numpy ships this module untyped
    with tmp.open("wb") as f:
        header = {"descr": fmt.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (rows, dim)}
        fmt.write_array_header_2_0(f, header)
        for chunk in chunks:
            if chunk.ndim != 2 or chunk.shape[1] != dim:
                raise ValueError(f"chunk of shape {chunk.shape}, expected (*, {dim})")
            f.write(np.ascontiguousarray(chunk, dtype=dtype).tobytes())
            written += len(chunk)
    if written != rows:
        tmp.unlink()
        raise ValueError(f"wrote {written} rows, announced {rows}")
    tmp.replace(path)
    return path
