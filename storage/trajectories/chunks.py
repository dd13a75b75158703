"""Trajectory store, chunk room: element ranges of a segment's arrays as byte ranges of chunks.

Why it exists: every array of a segment is stored uncompressed (Zarr's ``bytes`` codec alone,
little-endian, fill value 0), so row ``i`` of chunk ``c`` sits at byte ``(i - c * rows) *
row_bytes`` of that chunk's object. The writer appends a batch by writing those bytes in place
and the reader fetches a range with one read per covering chunk: no read-modify-write of a
partly filled chunk, no codec pipeline, no event loop round trip per batch. Zarr still creates
and resizes the arrays (their ``zarr.json``), and any Zarr reader reads the chunks as usual.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
import zarr
from zarr.codecs import BytesCodec
from zarr.core.metadata.v3 import ArrayV3Metadata

#: one byte range of one chunk: (key in the segment's store, chunk size in bytes, byte offset
#: within the chunk, number of bytes, byte offset within the caller's buffer).
Piece = tuple[str, int, int, int, int]


def regular_chunk_shape(meta: ArrayV3Metadata) -> tuple[int, ...] | None:
    """The chunk shape of an array whose chunk grid is ``regular``, else None. Read from the grid's
    JSON form, which every Zarr 3 release writes alike (the class that holds it does not)."""
    grid = meta.chunk_grid.to_dict()
    if grid.get("name") != "regular":
        return None
    return tuple(int(c) for c in grid["configuration"]["chunk_shape"])


@dataclass(frozen=True)
class RawArray:
    """How to find the bytes of rows of one uncompressed array (``RawArray.of`` checks that)."""

    name: str
    dtype: np.dtype
    row_shape: tuple[int, ...]  # shape of one row (``()`` for a 1-D array)
    chunk_rows: int  # rows per chunk
    row_bytes: int
    key: Callable[[int], str]  # chunk number -> key of its object in the segment's store

    @classmethod
    def of(cls, arr: zarr.Array, name: str, dtype: np.dtype) -> "RawArray":
        """``arr``'s layout; ``ValueError`` when its chunks are not plain little-endian bytes of
        ``dtype`` (a segment this store did not write: read it with Zarr)."""
        return cls.from_metadata(arr.metadata, name, dtype)

    @classmethod
    def from_metadata(cls, meta: ArrayV3Metadata, name: str, dtype: np.dtype) -> "RawArray":
        """``of`` for an array's parsed ``zarr.json`` (no Zarr array object, no event loop)."""
        shape = tuple(int(s) for s in meta.shape)
        found = meta.dtype.to_native_dtype()
        chunks = regular_chunk_shape(meta)
        codecs = getattr(meta, "codecs", ())
        plain = (
            meta.zarr_format == 3 and sys.byteorder == "little"
            and len(codecs) == 1 and isinstance(codecs[0], BytesCodec)
            and getattr(codecs[0].endian, "value", codecs[0].endian) in (None, "little")
            and chunks is not None and chunks[1:] == shape[1:]
            and np.dtype(found) == dtype and meta.fill_value == 0
        )
        if not plain:
            raise ValueError(
                f"array {name!r} is not stored as uncompressed little-endian {dtype} chunks with fill value 0 "
                f"(codecs {codecs}, dtype {found}): this store reads and appends only the layout its "
                "writer creates; open this segment with Zarr directly or write it to a new store"
            )
        row_shape = shape[1:]
        ndim = len(shape)
        return cls(name, dtype, row_shape, chunks[0],
                   dtype.itemsize * math.prod(row_shape),
                   lambda c: f"{name}/{meta.encode_chunk_key((c,) + (0,) * (ndim - 1))}")

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_rows * self.row_bytes

    def pieces(self, start: int, stop: int, buf_offset: int = 0) -> list[Piece]:
        """Byte ranges holding rows ``[start, stop)``, in order; the caller's buffer holds them
        contiguously from ``buf_offset``."""
        out: list[Piece] = []
        row = start
        while row < stop:
            c = row // self.chunk_rows
            end = min(stop, (c + 1) * self.chunk_rows)
            out.append((self.key(c), self.chunk_bytes, (row - c * self.chunk_rows) * self.row_bytes,
                        (end - row) * self.row_bytes, buf_offset + (row - start) * self.row_bytes))
            row = end
        return out

    def empty(self, rows: int) -> np.ndarray:
        return np.empty((rows,) + self.row_shape, dtype=self.dtype)
