"""Zarr trajectory store: append-only segments written by RaaS nodes, read by trainers.

Why it exists: RaaS nodes produce trajectories faster than a scheduler round trip can carry
them, and trainers on other nodes need them without copies through Dask (the data layer serves
batches by reference: it lists and deletes segments, and reads no rows). A
store on shared storage, written by many processes and read by a few, with no locking, is
the narrow interface between them.

Rooms: ``layout`` (the schema: arrays, dtypes, packed batches, commit log records, markers),
``chunks`` (element ranges of an array as byte ranges of its chunks), ``writer``
(``SegmentWriter``: appending and committing), ``reader`` (``open_trajectory_store``,
``TrajectoryStore``: what is committed, reading entries, and ``batch``: one published batch
without its tokens, for monitors), ``segment_view`` (``SegmentView``: one segment's committed
entries, opened once and kept), ``columns`` (``Columns``: many entries read as concatenated
arrays), ``rotating`` (``RotatingWriter``: one writer's entries over a series of bounded segments),
``backends`` (where the bytes live: a directory), ``locations`` (what a store URL names, and
the run that owns a store) and ``memory`` (in-process stores).

Reading
-------
``store.read_columns(refs) -> Columns`` is the fast path (trainers): the entries ``refs`` name,
in that order, as one array per per-token column (``tokens`` int32, ``loss_mask`` uint8,
``logprobs`` float32, ``policy_ids`` int16, ``versions`` int32, all concatenated) plus
``offsets`` (int64, ``len(refs) + 1``, from 0: entry ``i`` owns ``[offsets[i], offsets[i+1])``
of every per-token array), the per-entry ``seq_index``, ``num_sequences``, ``reward`` arrays
and the string columns ``task_id``, ``group_id``, ``finish_reason``, ``meta`` as lists. Each
run of nearby entries is read with one read per array per batch and copied once (read straight
into the columns when the refs name consecutive entries); no per-entry object is built. A
trainer builds its tensors from it directly::

    cols = store.read_columns(refs)
    tokens = torch.from_numpy(cols.tokens)            # packed; cu_seqlens = cols.offsets
    padded = torch.from_numpy(cols.padded("tokens", pad=pad_id))   # (len(refs), longest)
    mask = torch.from_numpy(cols.padded("loss_mask")).bool()

``cols.split(name)`` gives one view per entry, ``cols.row(i)`` / ``cols.rows()`` give
``StoredSequence`` objects (views of the columns; ``copy=True`` for arrays of their own).
``store.read(refs)`` is ``read_columns(refs).rows(copy=True)``: one ``StoredSequence`` per
entry owning its arrays (trainers' rows, tests, tools). Both raise ``EntryNotCommitted`` naming the
first refs no commit covers.

Layout and commit protocol
--------------------------
Each writer owns one *segment* (a RaaS node writes its own; nobody else writes to it), so no
two processes ever write the same Zarr chunk and nothing relies on Zarr locking (it has none).
A segment (``paths.segment_dir``) is a Zarr v3 group (``paths.segment_data_dir``) holding

* ``data``, a flat uint8 array (4 MiB chunks) of *packed batches*, one after another: a
  batch's per-token arrays ``tokens`` int32, ``loss_mask`` uint8, ``logprobs`` float32,
  ``policy_ids`` int16, ``versions`` int32, then its per-entry ``index`` int64 rows (the
  columns of ``INDEX_COLUMNS``: offset into the segment's tokens, length, seq_index,
  num_sequences) and ``reward`` float64 (exact as written), each little-endian and directly
  after the one before (``layout.packed_offsets``). One batch is one stretch of ``data`` (one
  chunk file unless it crosses a chunk boundary), so making it durable flushes that file and
  the log, not one file per array;
* ``commits/log``: the segment's commit log, one record per ``write``: a header (magic, payload
  length, crc32 of length and payload) and a JSON payload naming the write's batches (seqnos
  from the record's first), each with its entry range, token range, byte offset in ``data``,
  string columns (task_id, group_id, finish_reason, meta) and the crc32 of its bytes, plus the
  writer machine's boot id. A record naming packed batches has a magic of its own, so code
  that reads only the per-array layout stops there instead of misreading them;
* in segments written before packing (layout versions 2 and 3), one Zarr array per array
  above (``tokens`` ... ``reward``, 1 MiB or 128 KiB chunks, taken from each ``zarr.json``)
  and, before the commit log (version 2), ``commits/<seqno>.json``: one commit marker per
  batch with the same fields but the crc and offset. Both are still read; a writer continuing
  such a segment goes on with packed batches in the log from the next seqno.

Every array is uncompressed (Zarr's ``bytes`` codec alone, little-endian, fill value 0), so
any Zarr reader opens a segment, and this store moves byte ranges of chunk files itself
(``chunks``): appending writes a batch's bytes in place at their offset (a new chunk file is
created at its full size first), reading fetches one range per array per batch. Zarr writes
only the array's metadata. ``data`` is over-allocated and resized only by the segment's
writer; the committed length lives in the commit records, never in the array shape.

A ``submit`` call publishes its rows in batches of ``batch_size`` in two steps: (1) the bytes
of every batch are written, at once, in the caller's thread; (2) the writer's committer
thread appends one record naming every batch staged since its last one to the commit log
and, when ``durable``, flushes the touched chunk files, new directories, new or resized
``zarr.json`` files and the log in one concurrent round (one journal commit, not one for the
data and another for a marker's name); then the futures ``submit`` returned resolve with
their refs. Batches staged while a round flushes go into the next record together, so a
node that writes on while its last batch commits pays one round for several; ``write`` is
``submit`` and wait, and records follow each other only after the round before returned.
A failed round fails its futures, every later one and the writer. Readers trust only intact records that
continue the ones before, so an entry whose writer died between (1) and (2) is never visible.
A machine crash during the round can keep the record and lose data it names, so the last
record counts only if a later record follows it (written after its round returned), if this
machine wrote it in its current boot (the data went into the page cache first), or if the
bytes it names match its crcs; a record cut short or damaged ends what is committed. A
restarted writer cuts the log after the last record that counts and continues there,
overwriting the orphaned bytes.

Overlap invariant (writer vs. readers): a reader may read a chunk file while the writer writes
into it. The writer writes only bytes past the committed token and entry ranges (the part of
the last chunk no commit covers yet) and never truncates or replaces a chunk file that holds
committed bytes, so every committed byte a reader asks for is stable; what it may see torn is
uncommitted and never returned.

Backends: a directory (``/path`` or ``file:///path``; shared filesystem; many processes) and
``memory://<name>`` (in-process registry by name; same semantics within one process; for tests
and benchmarks: a run refuses it, its processes could not share it, ``storage.config``).
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
from storage.trajectories.columns import Columns
from storage.trajectories.reader import CommittedBatch, TrajectoryStore, open_trajectory_store
from storage.trajectories.writer import SegmentWriter

__all__ = [
    "Columns",
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
