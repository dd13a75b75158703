"""Trajectory store, schema room: what a segment holds and the records that name its entries.

Why it exists: the writer and the reader of a segment must agree on the arrays, their dtypes
and chunking, the index columns and the commit marker record; this module is where that
agreement is written down, once (the package docstring describes the format as a whole).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np

#: version of the on-disk layout, recorded in the store's layout file; a store written with
#: another version is refused (version 2: the index has no per-entry version range).
LAYOUT_VERSION = 2

#: per-token arrays and their on-disk dtypes.
FLAT_DTYPES: dict[str, np.dtype] = {
    "tokens": np.dtype(np.int32),
    "loss_mask": np.dtype(np.uint8),
    "logprobs": np.dtype(np.float32),
    "policy_ids": np.dtype(np.int16),
    "versions": np.dtype(np.int32),
}
#: columns of the per-entry ``index`` array (int64).
INDEX_COLUMNS = ("offset", "length", "seq_index", "num_sequences")
#: every array of a segment and its on-disk dtype.
ARRAY_DTYPES: dict[str, np.dtype] = {**FLAT_DTYPES, "index": np.dtype(np.int64), "reward": np.dtype(np.float64)}
CHUNK_BYTES = 1024 * 1024
INDEX_CHUNK = 2048  # entries per index chunk
REWARD_CHUNK = CHUNK_BYTES // 8
#: per-entry string columns, kept in the commit markers (not in Zarr arrays).
STRING_COLUMNS = ("task_id", "group_id", "finish_reason", "meta")


def flat_chunk(name: str) -> int:
    """Elements per chunk of the per-token array ``name``."""
    return CHUNK_BYTES // FLAT_DTYPES[name].itemsize


@dataclass(frozen=True, eq=False)
class StoredSequence:
    """One stored entry: a single token sequence plus the keys the data layer indexes by.

    This is the on-disk schema and knows nothing of RL; ``astraflow.contracts.Trajectory``
    maps to and from it. Per-token arrays all have the same length. Written by a
    ``SegmentWriter`` (RaaS node), returned by ``TrajectoryStore.read`` (data layer, trainer)
    with the on-disk dtypes (``loss_mask`` comes back as uint8).
    """

    task_id: str
    group_id: str
    #: position of this sequence within its trajectory, and how many the trajectory has.
    seq_index: int
    num_sequences: int
    tokens: np.ndarray  # int32
    loss_mask: np.ndarray  # bool or uint8
    logprobs: np.ndarray  # float32
    policy_ids: np.ndarray  # int16
    versions: np.ndarray  # int32
    reward: float
    finish_reason: str
    #: JSON text with everything else (policies, workflow, kind, attempt, provenance, rewards).
    meta: str


@dataclass(frozen=True)
class EntryRef:
    """Where one committed entry lives: segment name and entry index within the segment.
    Returned by ``SegmentWriter.write``; passed to ``TrajectoryStore.read``. Stable forever."""

    segment: str
    index: int


class EntryNotCommitted(LookupError):
    """``read`` was asked for an entry that no commit marker covers (yet, or ever)."""


class SegmentConflict(RuntimeError):
    """Two live writers wrote one segment: the commit marker this writer wanted already exists."""


@dataclass
class Marker:
    """One commit marker, parsed: the entry and token ranges of a published batch and its
    string columns."""

    seqno: int
    start: int  # entry range [start, end)
    end: int
    tok_start: int  # token range [tok_start, tok_end)
    tok_end: int
    strings: dict[str, list[str]]
    written_at: float = 0.0  # the writer's time.time() when it published the batch

    @classmethod
    def parse(cls, seqno: int, data: bytes) -> "Marker":
        rec = json.loads(data)
        return cls(seqno, rec["entries"][0], rec["entries"][1], rec["tokens"][0], rec["tokens"][1],
                   {k: rec[k] for k in STRING_COLUMNS}, float(rec.get("written_at", 0.0)))


def marker_record(seqno: int, entries: tuple[int, int], tokens: tuple[int, int],
                  strings: dict[str, list[str]]) -> bytes:
    """The bytes of commit marker ``seqno`` (what ``Marker.parse`` reads back)."""
    rec = {"seqno": seqno, "entries": list(entries), "tokens": list(tokens), "written_at": time.time(), **strings}
    return json.dumps(rec).encode()


def layout_record() -> bytes:
    """The store's layout file: written once, when the store is created."""
    return json.dumps(
        {"kind": "astraflow-trajectory-store", "layout_version": LAYOUT_VERSION, "created_at": time.time()},
        sort_keys=True,
    ).encode()
