"""Trajectory store, schema room: what a segment holds and the records that name its entries.

Why it exists: the writer and the reader of a segment must agree on the arrays, their dtypes
and chunking, the index columns, the commit log record (and the commit marker record of
segments written before the log); this module is where that
agreement is written down, once (the package docstring describes the format as a whole).
"""

from __future__ import annotations

import json
import struct
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Iterable

import numpy as np

#: version of the on-disk layout, recorded in the store's layout file; a store written with
#: a version outside ``READABLE_LAYOUTS`` is refused (version 2: the index has no per-entry
#: version range; version 3: segments commit through a commit log; version 4: a batch's
#: arrays are packed one after another in the segment's ``data`` array).
LAYOUT_VERSION = 4
#: layouts this code reads: version 2 and 3 stores keep each array in an array of its own
#: (version 2 with commit markers instead of a log). Their first writer here marks the store
#: version 4, so older code refuses it instead of misreading the packed batches.
READABLE_LAYOUTS = (2, 3, 4)

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
#: every array of a batch and its on-disk dtype.
ARRAY_DTYPES: dict[str, np.dtype] = {**FLAT_DTYPES, "index": np.dtype(np.int64), "reward": np.dtype(np.float64)}
#: the array that holds the packed batches (bytes), and its chunk size.
DATA_ARRAY = "data"
DATA_CHUNK = 4 * 1024 * 1024
#: chunk size of the per-array layout's arrays (segments written before packing; its
#: readers take each array's chunking from its ``zarr.json``, tests write it with this).
CHUNK_BYTES = 1024 * 1024
#: per-entry string columns, kept in the commit markers (not in Zarr arrays).
STRING_COLUMNS = ("task_id", "group_id", "finish_reason", "meta")


def row_bytes(name: str) -> int:
    """Bytes one row of array ``name`` takes (a token of a per-token array, an entry of the others)."""
    return ARRAY_DTYPES[name].itemsize * (len(INDEX_COLUMNS) if name == "index" else 1)


def packed_offsets(entries: int, tokens: int) -> dict[str, int]:
    """Where each array starts within a packed batch of ``entries`` entries and ``tokens``
    tokens, in ``CRC_ORDER``, plus ``""``: the batch's size. Nothing pads between arrays."""
    out, at = {}, 0
    for name in CRC_ORDER:
        out[name] = at
        at += (tokens if name in FLAT_DTYPES else entries) * row_bytes(name)
    out[""] = at
    return out


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


@dataclass(slots=True)
class Marker:
    """One published batch, parsed (from its commit marker, or from a commit log record): its
    entry and token ranges and its string columns."""

    seqno: int
    start: int  # entry range [start, end)
    end: int
    tok_start: int  # token range [tok_start, tok_end)
    tok_end: int
    strings: dict[str, list[str]] | None
    written_at: float = 0.0  # the writer's time.time() when it published the batch
    data_crc: int | None = None  # ``data_crc`` of the batch's bytes (commit log records only)
    boot: str = ""  # ``BOOT_ID`` of the machine that wrote the record ("" for markers)
    #: byte offset of the packed batch in the segment's ``data`` array; -1: each array of the
    #: batch lives in an array of its own (segments written before packing)
    data_at: int = -1
    #: where a reader found it in the commit log: its record's payload ``[start, end)`` and its
    #: place among the record's batches; ``None`` for a commit marker file. A reader may drop
    #: ``strings`` (``None``) and read them back from there.
    record: tuple[int, int, int] | None = None

    @property
    def packed(self) -> bool:
        return self.data_at >= 0

    def offset(self, name: str) -> int:
        """Where array ``name`` of the packed batch starts in ``data`` (``packed_offsets`` from
        ``data_at``; ``""``: where the batch ends)."""
        entries, tokens = self.end - self.start, self.tok_end - self.tok_start
        return self.data_at + _PER_ENTRY[name] * entries + _PER_TOKEN[name] * tokens

    @property
    def data_end(self) -> int:
        """End of the packed batch's bytes in ``data``."""
        return self.offset("")

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


#: the arrays whose bytes a batch's ``data_crc`` covers, in this order (its token range of the
#: per-token arrays, its entry range of the others).
CRC_ORDER = (*FLAT_DTYPES, "index", "reward")
#: ``packed_offsets`` is linear in a batch's entries and tokens: per array (and ``""``, the
#: batch's size) the bytes before it per entry and per token, so a batch needs no table of its own
_PER_ENTRY = packed_offsets(1, 0)
_PER_TOKEN = packed_offsets(0, 1)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


#: this machine's boot: a record written in the current boot of the machine reading it needs no
#: data check (its data was written before it, into the page cache the reader reads; only a
#: crash, which ends the boot, can lose data a record names). "" where unknown: always checked.
BOOT_ID = _boot_id()

#: commit log record header: magic, payload length, crc32 of the length field and the payload.
_LOG_HEAD = struct.Struct("<4sII")
_LOG_MAGIC = b"AFCL"
#: the magic of a record naming packed batches: code that reads only the per-array layout
#: stops at it (what it committed is all it serves) instead of reading packed bytes as arrays.
_LOG_MAGIC_PACKED = b"AFC4"


def data_crc(parts: Iterable[memoryview | bytes]) -> int:
    """crc32 of ``parts`` in turn (a batch's bytes, array by array in ``CRC_ORDER``)."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def log_record(batches: list[Marker]) -> bytes:
    """One commit log record: the batches one ``write`` publishes (consecutive seqnos and
    ranges, each with its ``data_crc``), framed so that a reader detects a record cut short or
    damaged (``parse_log``)."""
    listed = [{"entries": [m.start, m.end], "tokens": [m.tok_start, m.tok_end], "crc": m.data_crc,
               **({"data": m.data_at} if m.packed else {}), **m.strings}
              for m in batches]
    first = batches[0]
    payload = json.dumps({"seqno": first.seqno, "written_at": first.written_at, "boot": first.boot,
                          "batches": listed}).encode()
    length = struct.pack("<I", len(payload))
    magic = _LOG_MAGIC_PACKED if any(m.packed for m in batches) else _LOG_MAGIC
    return _LOG_HEAD.pack(magic, len(payload), zlib.crc32(payload, zlib.crc32(length))) + payload


def parse_log(data: bytes | memoryview, last: Marker | None, data_end: int = 0,
              base: int = 0) -> list[tuple[int, list[Marker]]]:
    """The whole, intact records at the start of ``data`` (commit log bytes from a record
    boundary, offset ``base`` of the log) that continue the batches up to ``last`` (and the
    packed bytes up to ``data_end``): ``(end offset in data, its batches)`` each. Stops at the first record that
    is incomplete (being appended, or cut short by a crash), fails its crc, or does not
    continue the one before it."""
    out: list[tuple[int, list[Marker]]] = []
    pos, seqno = 0, last.seqno + 1 if last else 0
    entries, tokens = (last.end, last.tok_end) if last else (0, 0)
    while pos + _LOG_HEAD.size <= len(data):
        magic, n, crc = _LOG_HEAD.unpack_from(data, pos)
        end = pos + _LOG_HEAD.size + n
        if magic not in (_LOG_MAGIC, _LOG_MAGIC_PACKED) or end > len(data):
            break
        payload = bytes(data[pos + _LOG_HEAD.size:end])
        if zlib.crc32(payload, zlib.crc32(struct.pack("<I", n))) != crc:
            break
        try:
            rec = json.loads(payload)
            boot, at = sys.intern(str(rec["boot"])), base + pos + _LOG_HEAD.size
            batches = [Marker(seqno + k, b["entries"][0], b["entries"][1], b["tokens"][0], b["tokens"][1],
                              {c: b[c] for c in STRING_COLUMNS}, float(rec["written_at"]), int(b["crc"]),
                              boot, int(b.get("data", -1)), (at, base + end, k))
                       for k, b in enumerate(rec["batches"])]
        except (ValueError, KeyError, TypeError, IndexError):
            break
        if rec.get("seqno") != seqno or not batches:
            break
        for m in batches:
            # a packed batch continues the packed bytes; a batch of the per-array layout (code
            # before packing) never follows a packed one: its rows would hide theirs
            if (m.start, m.tok_start) != (entries, tokens) or m.end < m.start or m.tok_end < m.tok_start \
                    or (m.data_at != data_end if m.packed else data_end > 0):
                return out
            entries, tokens = m.end, m.tok_end
            data_end = m.data_end if m.packed else data_end
        seqno += len(batches)
        out.append((end, batches))
        pos = end
    return out


def record_strings(payload: bytes, k: int) -> dict[str, list[str]]:
    """The string columns of batch ``k`` of a commit log record's ``payload`` (``Marker.record``)."""
    b = json.loads(payload)["batches"][k]
    return {c: b[c] for c in STRING_COLUMNS}


def layout_record() -> bytes:
    """The store's layout file: written once, when the store is created."""
    return json.dumps(
        {"kind": "astraflow-trajectory-store", "layout_version": LAYOUT_VERSION, "created_at": time.time()},
        sort_keys=True,
    ).encode()
