"""``RotatingWriter``: one writer's entries over a series of bounded segments."""

from __future__ import annotations

import threading

import pytest

from storage.trajectories import open_trajectory_store
from storage.trajectories.rotating import RotatingWriter
from storage_workers import make_row, rows_equal


def test_a_full_segment_is_closed_and_the_next_one_started(tmp_path):
    store = open_trajectory_store(str(tmp_path / "t"), "a")
    w = RotatingWriter(store, "node.ab12", batch_size=2, max_entries=5)
    futures = [w.submit([make_row(0, 3 * k + j) for j in range(3)]) for k in range(5)]
    w.flush()
    refs = [r for f in futures for r in f.result()]
    w.close()
    # calls of 3 rows, at most 5 a segment: a call never splits, the next call starts a new segment
    assert [r.segment for r in refs] == ["node.ab12"] * 6 + ["node.ab12.1"] * 6 + ["node.ab12.2"] * 3
    assert w.closed_segments == ["node.ab12", "node.ab12.1"]
    assert w.take_closed() == ["node.ab12", "node.ab12.1"] and w.take_closed() == []  # taken once: none kept
    reader = open_trajectory_store(str(tmp_path / "t"), "r")
    assert {s: reader.count(s) for s in reader.segments()} == {"node.ab12": 6, "node.ab12.1": 6, "node.ab12.2": 3}
    assert all(rows_equal(got, make_row(0, i)) for i, got in enumerate(reader.read(refs)))


def test_writes_from_several_threads_all_land_once(tmp_path):
    store = open_trajectory_store(str(tmp_path / "t"), "a")
    w = RotatingWriter(store, "n", batch_size=4, max_entries=7)
    refs: list = []
    lock = threading.Lock()

    def work(t: int) -> None:
        for k in range(6):
            got = w.write([make_row(t, 2 * k), make_row(t, 2 * k + 1)])
            with lock:
                refs.extend(got)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    assert len(refs) == len(set(refs)) == 36
    reader = open_trajectory_store(str(tmp_path / "t"), "r")
    assert sum(reader.count(s) for s in reader.segments()) == 36
    assert max(reader.count(s) for s in reader.segments()) <= 8  # a call's two rows may pass the bound by one
    rows = reader.read(refs)
    assert sorted((r.task_id for r in rows)) == sorted(f"w{t}/t{i}" for t in range(3) for i in range(12))


def test_a_writer_continues_a_segment_its_predecessor_left(tmp_path):
    """A node restarted under the same segment name goes on after what was committed, and
    counts it towards the bound."""
    store = open_trajectory_store(str(tmp_path / "t"), "a")
    with RotatingWriter(store, "n", batch_size=4, max_entries=4) as w:
        w.write([make_row(0, i) for i in range(3)])
    with RotatingWriter(store, "n", batch_size=4, max_entries=4) as w:
        first = w.write([make_row(0, 3)])
        second = w.write([make_row(0, 4)])
    assert [r.segment for r in first + second] == ["n", "n.1"] and first[0].index == 3


def test_a_bound_below_one_is_refused(tmp_path):
    store = open_trajectory_store(str(tmp_path / "t"), "a")
    with pytest.raises(ValueError, match="max_entries"):
        RotatingWriter(store, "n", batch_size=4, max_entries=0)
