"""Grouped commits: ``submit`` writes a batch's bytes at once and the writer's committer thread
names everything staged since its last flush round in one record and one round.

The flush round is held at its start (``sync_together`` waits on an event) to make the
interleavings these tests need: batches staged while a round is being made durable, a round
that fails."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

import storage.trajectories.backends as backends
from storage import paths
from storage.trajectories import EntryRef, open_trajectory_store
from storage.trajectories.layout import parse_log
from storage_workers import make_row, rows_equal


class _HeldRounds:
    """Replaces ``sync_together``: each flush round waits until released, then syncs (or
    raises what ``fail`` holds)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.started = threading.Semaphore(0)
        self.release = threading.Semaphore(0)
        self.rounds = 0
        self.fail: BaseException | None = None
        real = backends.sync_together

        def held(data_files=(), full=()):
            self.rounds += 1
            self.started.release()
            assert self.release.acquire(timeout=30), "the test never released the flush round"
            if self.fail is not None:
                raise self.fail
            real(data_files, full)

        monkeypatch.setattr(backends, "sync_together", held)

    def wait_started(self) -> None:
        assert self.started.acquire(timeout=30), "no flush round started"


def _records(root, segment: str) -> list[int]:
    """Batches per record of the segment's commit log."""
    return [len(batches) for _, batches in parse_log(paths.commit_log(root, segment).read_bytes(), None)]


@pytest.mark.timeout(60)
def test_batches_staged_during_a_flush_round_commit_together_in_the_next(tmp_path, monkeypatch):
    rounds = _HeldRounds(monkeypatch)
    root = tmp_path / "store"
    w = open_trajectory_store(str(root)).writer("seg", batch_size=4)
    first = w.submit([make_row(1, i) for i in range(4)])
    rounds.wait_started()  # round 1 is flushing batch 0
    later = [w.submit([make_row(1, i) for i in range(k, k + 4)]) for k in range(4, 16, 4)]
    assert not first.done() and not any(f.done() for f in later)
    rounds.release.release()
    assert [r.index for r in first.result(30)] == [0, 1, 2, 3]
    rounds.wait_started()  # round 2: the three batches staged meanwhile, in one record
    assert not any(f.done() for f in later)
    rounds.release.release()
    assert [[r.index for r in f.result(30)] for f in later] == [list(range(k, k + 4)) for k in (4, 8, 12)]
    assert rounds.rounds == 2 and _records(root, "seg") == [1, 3]
    got = open_trajectory_store(str(root), "r").read([EntryRef("seg", i) for i in range(16)])
    assert all(rows_equal(make_row(1, i), got[i]) for i in range(16))
    w.close()


@pytest.mark.timeout(60)
def test_a_failed_flush_round_fails_what_waits_and_the_writer(tmp_path, monkeypatch):
    """What was staged behind a failed round is never committed (its record would follow one
    that may not be durable); the writer refuses more, and a new writer continues after what a
    reader sees committed."""
    rounds = _HeldRounds(monkeypatch)
    root = tmp_path / "store"
    store = open_trajectory_store(str(root))
    w = store.writer("seg", batch_size=4)
    first = w.submit([make_row(2, i) for i in range(4)])
    rounds.wait_started()
    behind = w.submit([make_row(2, i) for i in range(4, 8)])
    rounds.fail = OSError(5, "Input/output error")
    rounds.release.release()
    with pytest.raises(OSError, match="Input/output"):
        first.result(30)
    with pytest.raises(RuntimeError, match="earlier commit"):
        behind.result(30)
    with pytest.raises(RuntimeError, match="failed to commit"):
        w.submit([make_row(2, 8)])
    with pytest.raises(OSError, match="Input/output"):
        w.flush()
    w.close()
    assert _records(root, "seg") == [1]  # the failed round's record; nothing behind it
    seen = open_trajectory_store(str(root), "r").count("seg")
    monkeypatch.undo()  # the disk works again
    w2 = store.writer("seg", batch_size=4)
    assert [r.index for r in w2.write([make_row(3, i) for i in range(2)])] == [seen, seen + 1]
    w2.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("url", ["dir", "memory"])
def test_close_commits_everything_submitted(tmp_path, url):
    url = str(tmp_path / "store") if url == "dir" else f"memory://group-commit-{tmp_path.name}"
    w = open_trajectory_store(url).writer("seg", batch_size=3)
    futures = [w.submit([make_row(4, i) for i in range(k, k + 5)]) for k in range(0, 50, 5)]
    w.close()
    assert all(f.done() for f in futures)
    assert [r.index for f in futures for r in f.result()] == list(range(50))
    got = open_trajectory_store(url, "r").read([EntryRef("seg", i) for i in range(50)])
    assert all(rows_equal(make_row(4, i), got[i]) for i in range(50))
    with pytest.raises(ValueError, match="closed"):
        w.submit([make_row(4, 50)])


@pytest.mark.timeout(60)
def test_rows_that_cannot_be_stored_are_refused_before_anything_is_queued(tmp_path):
    w = open_trajectory_store(str(tmp_path / "store")).writer("seg", batch_size=2)
    bad = replace(make_row(5, 1), loss_mask=make_row(5, 1).loss_mask[:-1])
    with pytest.raises(ValueError, match="one value per token"):
        w.submit([make_row(5, 0), make_row(5, 2), bad])  # its first batch's bytes were written
    refs = w.submit([make_row(5, i) for i in range(3)]).result(30)
    assert [r.index for r in refs] == [0, 1, 2]  # ... and are overwritten
    got = open_trajectory_store(str(tmp_path / "store"), "r").read(refs)
    assert all(rows_equal(make_row(5, i), got[i]) for i in range(3))
    w.close()


@pytest.mark.timeout(60)
def test_a_commit_goes_on_whoever_stops_waiting_for_it(tmp_path, monkeypatch):
    """A caller that stops waiting (an asyncio task cancelled while awaiting the future)
    cannot cancel the commit: the batch is committed and later ones are too."""
    rounds = _HeldRounds(monkeypatch)
    root = tmp_path / "store"
    w = open_trajectory_store(str(root)).writer("seg", batch_size=4)
    first = w.submit([make_row(6, i) for i in range(4)])
    rounds.wait_started()
    assert not first.cancel()
    rounds.release.release()
    assert [r.index for r in first.result(30)] == [0, 1, 2, 3]
    later = w.submit([make_row(6, i) for i in range(4, 8)])
    rounds.wait_started()
    rounds.release.release()
    assert [r.index for r in later.result(30)] == [4, 5, 6, 7]
    w.close()
    assert open_trajectory_store(str(root), "r").count("seg") == 8


@pytest.mark.timeout(60)
def test_a_close_racing_a_submit_commits_its_rows_before_releasing_the_segment(tmp_path, monkeypatch):
    """A ``close`` that runs after a ``submit`` queued its rows and before it woke the committer
    (made here by closing from inside that wake-up) commits them before releasing the segment:
    no record follows the release, where a successor writer may be writing."""
    root = tmp_path / "store"
    w = open_trajectory_store(str(root)).writer("seg", batch_size=4)
    events: list[str] = []
    append, release = w._backend.append_log, w._backend.release_segment
    monkeypatch.setattr(w._backend, "append_log", lambda *a: (events.append("append"), append(*a))[1])
    monkeypatch.setattr(w._backend, "release_segment", lambda *a: (events.append("release"), release(*a))[1])
    wake = type(w)._wake_committer

    def close_first(self):
        self.close()
        wake(self)

    monkeypatch.setattr(type(w), "_wake_committer", close_first)
    done = w.submit([make_row(7, i) for i in range(2)])
    assert [r.index for r in done.result(30)] == [0, 1]
    assert events == ["append", "release"]
    with pytest.raises(ValueError, match="closed"):
        w.submit([make_row(7, 2)])
    got = open_trajectory_store(str(root), "r").read(done.result())
    assert all(rows_equal(make_row(7, i), got[i]) for i in range(2))
