"""Zarr trajectory store: append-only segments written by RaaS nodes, read by the data layer.

Why it exists: RaaS nodes produce trajectories faster than a scheduler round trip can carry
them, and trainers/the data layer on other nodes need them without copies through Dask. A
store on shared storage, written by many processes and read by a few, with no locking, is
the narrow interface between them.

Rooms: ``layout`` (the schema: arrays, dtypes, index columns, marker and entry records),
``writer`` (``SegmentWriter``: appending and committing), ``reader`` (``open_trajectory_store``,
``TrajectoryStore``: what is committed, reading entries, and ``batch``: one published batch
without its tokens, for monitors), ``backends`` (where the bytes live).

Layout and commit protocol
--------------------------
Each writer owns one *segment* (a RaaS node writes its own; nobody else writes to it), so no
two processes ever write the same Zarr chunk and nothing relies on Zarr locking (it has none).
A segment (``paths.segment_dir``) is a Zarr v3 group (``paths.segment_data_dir``) holding

* flat per-token arrays ``tokens`` int32, ``loss_mask`` uint8, ``logprobs`` float32,
  ``policy_ids`` int16, ``versions`` int32 (128 KiB chunks, uncompressed);
* per-entry index arrays ``index`` int64 of shape ``(N, 4)`` with the columns of
  ``INDEX_COLUMNS`` (offset into the flat arrays, length, seq_index, num_sequences) and
  ``reward`` float64 (float64, not float32: a reward reads back exactly as written);
* ``commits/<seqno>.json``: one commit marker per published batch, holding the batch's entry
  range, token range and string columns (task_id, group_id, finish_reason, meta).

Arrays are over-allocated (capacity doubles) and resized only by the segment's writer; the
committed length lives in the markers, never in the array shape. A batch is published in two
steps: (1) the chunk data of the flat and index arrays is written, one concurrent Zarr call per
array (and, when ``durable``, every touched chunk file is fsynced); (2) the commit marker is
created atomically (``storage.atomic.create_atomically``: write temp, fsync, ``os.link``
create-if-absent, fsync the directory; no fsync when the store is not ``durable``). Readers
trust only markers, so an entry whose writer died between (1) and (2) is never visible, and a
restarted writer continues after the last marker, overwriting the orphaned chunk data.

Overlap invariant (writer vs. readers): a reader may read a chunk while the writer rewrites it
(the last, partly filled chunk is rewritten by the next batch). Zarr's LocalStore replaces a
chunk file atomically (temp + rename), and the rewrite preserves every committed byte, so the
reader sees either version and both hold the committed range it asked for.

Backends: a directory (``/path`` or ``file:///path``; shared filesystem; many processes) and
``memory://<name>`` (in-process registry by name; same semantics within one process; tests and
the embedded default).
"""

from storage.trajectories.layout import (
    FLAT_DTYPES,
    INDEX_COLUMNS,
    LAYOUT_VERSION,
    EntryNotCommitted,
    EntryRef,
    SegmentConflict,
    StoredSequence,
)
from storage.trajectories.reader import CommittedBatch, TrajectoryStore, open_trajectory_store
from storage.trajectories.writer import SegmentWriter

__all__ = [
    "CommittedBatch",
    "FLAT_DTYPES",
    "INDEX_COLUMNS",
    "LAYOUT_VERSION",
    "EntryNotCommitted",
    "EntryRef",
    "SegmentConflict",
    "SegmentWriter",
    "StoredSequence",
    "TrajectoryStore",
    "open_trajectory_store",
]
