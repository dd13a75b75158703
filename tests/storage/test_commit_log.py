"""Trajectory store: the commit log after a crash, and segments written before it.

A durable write is one flush round of the chunk data and the log record together, so a
machine crash during the round can leave a record cut short, a record whose data did not
reach the disk, or both. These tests make those states on disk (truncating the log, changing
bytes the record covers, removing a chunk file created by the write; the records marked as
written in an earlier boot of the machine, as they are after a crash) and check that readers
in this and in other processes serve only what a write that returned committed, and that the
segment's next writer cuts the leftover off and continues where the last intact record ends.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import numpy as np
import pytest

from storage import paths
from storage.trajectories import EntryNotCommitted, EntryRef, LAYOUT_VERSION, open_trajectory_store
from dataclasses import replace

from storage.trajectories.layout import log_record, parse_log
from storage_workers import (
    as_marker_layout, as_per_array_layout, committed_refs, make_row, rows_equal, token_position,
)


def _three_writes(root) -> list[int]:
    """Writes of 5, 3 and 4 rows (batches of 2: records of 3, 2 and 2 batches), then a crash
    of the machine (the records are from an earlier boot); the log's record ends."""
    w = open_trajectory_store(str(root)).writer("seg", batch_size=2)
    w.write([make_row(1, i) for i in range(5)])
    w.write([make_row(1, i) for i in range(5, 8)])
    w.write([make_row(1, i) for i in range(8, 12)])
    w.close()
    return _from_an_earlier_boot(root)


def _from_an_earlier_boot(root) -> list[int]:
    """The segment's records as a machine crash leaves them: written in an earlier boot (a
    reader checks the last one's data); the log's record ends."""
    log = paths.commit_log(root, "seg")
    records = parse_log(log.read_bytes(), None)
    log.write_bytes(b"".join(log_record([replace(m, boot="an-earlier-boot") for m in batches])
                             for _, batches in records))
    return [end for end, _ in parse_log(log.read_bytes(), None)]


def _count_in_child(url: str, segment: str, out) -> None:
    out.put(open_trajectory_store(url, "r").count(segment))


def _count_elsewhere(root) -> int:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_count_in_child, args=(str(root), "seg", q))
    p.start()
    try:
        return q.get(timeout=60)
    finally:
        p.join(timeout=30)
        if p.is_alive():  # stuck: the test started it, the test ends it
            p.kill()
            p.join(10)


def _served_rows_are_the_written_ones(root, n: int) -> None:
    reader = open_trajectory_store(str(root), "r")
    assert committed_refs(reader) == [EntryRef("seg", i) for i in range(n)]
    assert all(rows_equal(make_row(1, i), r) for i, r in enumerate(reader.read(committed_refs(reader))))
    with pytest.raises(EntryNotCommitted):
        reader.read([EntryRef("seg", n)])


def _continue_and_check(root, n: int) -> None:
    """A new writer continues after entry ``n`` and its rows, not the leftovers, are served."""
    w = open_trajectory_store(str(root)).writer("seg", batch_size=2)
    refs = w.write([make_row(2, i) for i in range(3)])
    assert [r.index for r in refs] == [n, n + 1, n + 2]
    reader = open_trajectory_store(str(root), "r")
    got = reader.read(committed_refs(reader))
    assert len(got) == n + 3
    assert all(rows_equal(make_row(1, i), got[i]) for i in range(n))
    assert all(rows_equal(make_row(2, k), got[n + k]) for k in range(3))
    view = reader._view("seg")  # nothing is left after the last record
    assert view.log_end == paths.commit_log(root, "seg").stat().st_size > 0


@pytest.mark.parametrize("cut", [1, 11, "half", -1])
def test_a_record_cut_short_is_not_committed_and_the_next_writer_cuts_it_off(tmp_path, cut):
    root = tmp_path / "store"
    ends = _three_writes(root)
    log = paths.commit_log(root, "seg")
    size = (ends[1] + ends[2]) // 2 if cut == "half" else ends[2] - 1 if cut == -1 else ends[1] + cut
    os.truncate(log, size)
    _served_rows_are_the_written_ones(root, 8)
    assert open_trajectory_store(str(root), "r").batch_count("seg") == 5
    assert _count_elsewhere(root) == 8
    _continue_and_check(root, 8)


def test_a_damaged_record_ends_what_is_committed(tmp_path):
    """A byte changed in the middle record: it and the record after it are not served (the
    crc of the record fails; nothing after the first bad record counts)."""
    root = tmp_path / "store"
    ends = _three_writes(root)
    log = paths.commit_log(root, "seg")
    data = bytearray(log.read_bytes())
    data[(ends[0] + ends[1]) // 2] ^= 0x20
    log.write_bytes(bytes(data))
    _served_rows_are_the_written_ones(root, 5)
    _continue_and_check(root, 5)


def test_a_last_record_whose_data_did_not_reach_the_disk_is_not_served(tmp_path):
    """The crash kept the last record but lost (part of) the data it commits: the record's
    data crc does not match, so readers here and elsewhere stop before it."""
    root = tmp_path / "store"
    _three_writes(root)
    # zeros where the last write's tokens were (what an unflushed page of a chunk reads as)
    chunk, start = token_position(root, "seg", 5)
    with open(chunk, "r+b") as f:
        f.seek(start)
        f.write(bytes(16))
    _served_rows_are_the_written_ones(root, 8)
    assert _count_elsewhere(root) == 8
    _continue_and_check(root, 8)


@pytest.mark.parametrize("lost", ["name", "size"])
def test_a_record_whose_new_chunk_file_was_lost_is_not_served(tmp_path, monkeypatch, lost):
    """The last write created a chunk file (small chunks here) whose name, or whose size, the
    crash lost: the chunk reads as missing or too short, the record's data check fails, and the
    record before it is what counts."""
    import storage.trajectories.writer as writer_mod

    monkeypatch.setattr(writer_mod, "DATA_CHUNK", 8192)
    root = tmp_path / "store"
    w = open_trajectory_store(str(root)).writer("seg", batch_size=2)
    w.write([make_row(1, i, length=100) for i in range(4)])  # 400 tokens: within the first chunk
    w.write([make_row(1, i, length=700) for i in range(4, 6)])  # into the second chunk and beyond
    w.close()
    _from_an_earlier_boot(root)
    chunk = str(paths.segment_data_dir(root, "seg") / "data" / "c" / "1")
    if lost == "name":
        os.unlink(chunk)
    else:
        os.truncate(chunk, 0)
    reader = open_trajectory_store(str(root), "r")
    assert reader.count("seg") == 4
    got = reader.read(committed_refs(reader))
    assert all(rows_equal(make_row(1, i, length=100), r) for i, r in enumerate(got))


def test_a_record_is_served_once_its_data_is_there(tmp_path):
    """A reader that sees the last record before its data (another machine's writer still
    flushing) does not serve it, and does once the bytes match."""
    root = tmp_path / "store"
    _three_writes(root)
    last = open_trajectory_store(str(root), "r").batch("seg", 5)
    chunk, at = token_position(root, "seg", 5, token=int(last.index[-1, 0] - last.index[0, 0]))  # its last entry
    original = open(chunk, "rb").read()
    reader = open_trajectory_store(str(root), "r")
    assert reader.count("seg") == 12
    fresh = open_trajectory_store(str(root), "r")
    with open(chunk, "r+b") as f:
        f.seek(at)
        f.write(bytes(8))
    assert fresh.count("seg") == 8 and fresh.batch_count("seg") == 5
    with open(chunk, "r+b") as f:
        f.write(original)
    assert fresh.count("seg") == 12 and fresh.batch_count("seg") == 7
    assert all(rows_equal(make_row(1, i), r) for i, r in enumerate(fresh.read(committed_refs(fresh))))


def test_the_last_record_of_this_boot_is_served_without_reading_its_data(tmp_path, monkeypatch):
    """A record this machine wrote in its current boot has its data in the page cache (written
    before the record), so readers here take it without reading the data."""
    from storage.trajectories import reader as store_reader

    root = tmp_path / "store"
    w = open_trajectory_store(str(root)).writer("seg", batch_size=2)
    w.write([make_row(1, i) for i in range(5)])
    reads: list[tuple[int, int]] = []
    read_bytes = store_reader.SegmentView._read_bytes
    def counted(self, start, stop):
        reads.append((start, stop))
        return read_bytes(self, start, stop)

    monkeypatch.setattr(store_reader.SegmentView, "_read_bytes", counted)
    assert open_trajectory_store(str(root), "r").count("seg") == 5 and not reads
    _from_an_earlier_boot(root)
    assert open_trajectory_store(str(root), "r").count("seg") == 5 and len(reads) == 3  # each batch's bytes, once


def test_records_followed_by_another_are_not_read_for_their_crc(tmp_path):
    """Only the last record's data is checked: a record a later one follows was flushed before
    its successor was written. Changed bytes under an earlier record are served as they are
    (the check is for crashes, not for damage at rest)."""
    root = tmp_path / "store"
    _three_writes(root)
    chunk, at = token_position(root, "seg", 0)
    with open(chunk, "r+b") as f:
        f.seek(at)
        f.write(np.array([-7], np.int32).tobytes())  # the first token of entry 0
    reader = open_trajectory_store(str(root), "r")
    assert reader.count("seg") == 12
    assert reader.read([EntryRef("seg", 0)])[0].tokens[0] == -7


def test_a_segment_of_commit_markers_loads_and_continues_in_a_log(tmp_path):
    """A store whose segments have commit markers only (written before the commit log, layout
    version 2) reads as it did; its next writer continues the segment in a commit log and
    marks the store with the current layout version."""
    root = tmp_path / "store"
    _three_writes(root)
    as_marker_layout(root, "seg")
    assert not paths.commit_log(root, "seg").exists()
    assert sorted(p.name for p in paths.segment_commit_dir(root, "seg").iterdir()) == [
        paths.commit_marker(root, "seg", k).name for k in range(7)]
    old = open_trajectory_store(str(root), "r")
    assert old.count("seg") == 12 and old.batch_count("seg") == 7
    assert old.batch("seg", 6).strings["task_id"] == ["w1/t10", "w1/t11"]
    _served_rows_are_the_written_ones(root, 12)
    assert _count_elsewhere(root) == 12
    _continue_and_check(root, 12)
    assert json.loads(paths.store_layout_file(root).read_bytes())["layout_version"] == LAYOUT_VERSION
    again = open_trajectory_store(str(root), "r")
    assert [again.batch("seg", k).start for k in range(again.batch_count("seg"))] == [0, 2, 4, 5, 7, 8, 10, 12, 14]
    assert old.count("seg") == 15  # a reader opened before the log existed follows it too


def test_a_segment_written_before_packing_loads_checks_and_continues_packed(tmp_path):
    """A store whose segments keep each array in an array of its own, committed through a log
    (layout version 3), reads as it did, checks its last record's data against the crc of those
    arrays' bytes, and its next writer goes on with packed batches in the same log."""
    root = tmp_path / "store"
    _three_writes(root)
    as_per_array_layout(root, "seg")
    _from_an_earlier_boot(root)
    assert not (paths.segment_data_dir(root, "seg") / "data").exists()
    _served_rows_are_the_written_ones(root, 12)
    tokens = paths.segment_data_dir(root, "seg") / "tokens" / "c" / "0"
    original = tokens.read_bytes()
    with open(tokens, "r+b") as f:  # the last record's data lost (its last token zeroed)
        f.seek(len(b"".join(make_row(1, i).tokens.tobytes() for i in range(12))) - 4)
        f.write(bytes(4))
    assert open_trajectory_store(str(root), "r").count("seg") == 10  # one record per batch of 2
    tokens.write_bytes(original)
    assert _count_elsewhere(root) == 12
    _continue_and_check(root, 12)
    assert json.loads(paths.store_layout_file(root).read_bytes())["layout_version"] == LAYOUT_VERSION
    assert (paths.segment_data_dir(root, "seg") / "data" / "zarr.json").exists()


def test_a_chunk_file_missing_under_committed_entries_is_damage_not_zeros(tmp_path):
    """A writer makes every chunk file before a record names it: one missing under committed
    entries was lost (deleted, a bad copy), and reading its rows as zeros would hand a trainer
    wrong tokens with their real loss masks. The read names the file."""
    root = tmp_path / "store"
    w = open_trajectory_store(str(root)).writer("seg", batch_size=4)
    w.write([make_row(1, i, length=64) for i in range(8)])
    w.write([make_row(1, i, length=64) for i in range(8, 16)])
    w.close()
    chunk, _ = token_position(root, "seg", 0)
    os.unlink(chunk)
    with pytest.raises(OSError, match="is missing under committed entries: the segment is damaged") as err:
        open_trajectory_store(str(root), "r").read_columns([EntryRef("seg", i) for i in range(16)])
    assert str(chunk) in str(err.value)
