"""A long-lived reader keeps the string columns of the batches it used last only: the others
are dropped and read back from their commit log record (or marker file) when needed again."""

from __future__ import annotations

import pytest

from storage.trajectories import EntryRef, open_trajectory_store
from storage_workers import as_marker_layout, make_row, rows_equal


def _write(url: str, segments: int, per_segment: int, batch: int) -> None:
    store = open_trajectory_store(url)
    for w in range(segments):
        writer = store.writer(f"w{w}", batch_size=batch)
        for i in range(0, per_segment, 5):  # several records per segment, several batches per record
            writer.write([make_row(w, j) for j in range(i, min(i + 5, per_segment))])
        writer.close()


@pytest.mark.parametrize("where", ["dir", "memory"])
def test_the_strings_held_stay_within_the_budget_and_read_back_exact(tmp_path, where):
    url = str(tmp_path / "store") if where == "dir" else f"memory://kept-{tmp_path.name}"
    _write(url, segments=6, per_segment=40, batch=3)
    reader = open_trajectory_store(url, "r")
    reader.kept.budget = 10
    refs = [EntryRef(f"w{w}", i) for w in range(6) for i in range(40)]
    for _ in range(2):  # the second pass reads back every string the first one dropped
        for k in range(0, len(refs), 7):
            got = reader.read(refs[k:k + 7])
            assert all(rows_equal(g, make_row(int(r.segment[1:]), r.index)) for g, r in zip(got, refs[k:k + 7]))
            assert reader.kept.held <= 10 + 3  # the budget, plus at most the batch that went over it
    held = [m for w in range(6) for m in reader._view(f"w{w}").markers if m.strings is not None]
    assert sum(m.end - m.start for m in held) == reader.kept.held <= 13
    assert reader.batch("w0", 0).strings["task_id"] == ["w0/t0", "w0/t1", "w0/t2"]


def test_a_segment_of_marker_files_reads_its_dropped_strings_back(tmp_path):
    root = tmp_path / "store"
    _write(str(root), segments=1, per_segment=12, batch=2)
    as_marker_layout(root, "w0")
    reader = open_trajectory_store(str(root), "r")
    reader.kept.budget = 0  # nothing kept: every read goes back to the marker files
    refs = [EntryRef("w0", i) for i in range(12)]
    assert all(rows_equal(g, make_row(0, i)) for i, g in enumerate(reader.read(refs)))
    assert reader.kept.held == 0
    batches = [reader.batch("w0", k) for k in range(reader.batch_count("w0"))]
    assert [b.strings["meta"] for b in batches] == [[make_row(0, i).meta for i in range(b.start, b.end)]
                                                    for b in batches]
    assert batches[-1].end == 12


def test_a_long_lived_reader_keeps_the_views_of_the_segments_it_used_last_only(tmp_path, monkeypatch):
    """Nodes rotate their segments, so a trainer reading a run of days meets segment after
    segment: it keeps the parsed views of the last ``KEPT_VIEWS`` only, and one dropped reads
    back exact."""
    from storage.trajectories import reader as reader_module

    monkeypatch.setattr(reader_module, "KEPT_VIEWS", 4, raising=False)
    url = str(tmp_path / "store")
    _write(url, segments=12, per_segment=6, batch=2)
    reader = open_trajectory_store(url, "r")
    for w in range(12):
        assert rows_equal(reader.read([EntryRef(f"w{w}", 5)])[0], make_row(w, 5))
        assert len(reader._views) == min(w + 1, 4)
    assert list(reader._views) == ["w8", "w9", "w10", "w11"]
    reader.read([EntryRef("w9", 0)])  # used again: the last one dropped next
    assert rows_equal(reader.read([EntryRef("w0", 1)])[0], make_row(0, 1))
    assert list(reader._views) == ["w10", "w11", "w9", "w0"]
