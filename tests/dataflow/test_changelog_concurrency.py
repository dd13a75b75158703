"""The change log (``astraflow/dataflow/changelog.py``) under interleavings: a sync commit's
fsync running in a thread while a compaction starts a new log file, and commits that arrive
while ``close`` waits for what is in flight. The fsync is held on a gate to make them."""

from __future__ import annotations

import asyncio
import threading

import pytest

from astraflow.dataflow import changelog
from tests.dataflow.test_durable import Paths


class _HeldSync:
    """Replaces ``sync_together``: records what each call syncs; the first one waits until
    ``release`` is set (its fsyncs done before it waits)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls: list[list] = []
        self.started, self.release = threading.Event(), threading.Event()
        real = changelog.sync_together

        def held(data, full=()):
            self.calls.append(list(full))
            real(data, full)
            if len(self.calls) == 1:
                self.started.set()
                assert self.release.wait(30), "the test never released the fsync"

        monkeypatch.setattr(changelog, "sync_together", held)

    async def wait_started(self) -> None:
        assert await asyncio.to_thread(self.started.wait, 30), "no fsync started"


async def _until(cond) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0)
    assert cond()


@pytest.mark.timeout(60)
def test_a_sync_commit_into_a_new_log_file_fsyncs_the_directory(tmp_path, monkeypatch):
    """A directory fsync that started before a compaction created the next log file does not
    cover that file's entry: the next sync commit, written to it, fsyncs the directory."""
    held = _HeldSync(monkeypatch)
    paths = Paths(tmp_path)
    layer = paths.layer()
    log = layer.durability.log

    async def go():
        await layer.lease("n0", 1)
        first = asyncio.ensure_future(layer.durability.commit(sync=True))
        await held.wait_started()
        assert held.calls == [[paths.snapshot.parent]]  # the first log file's entry
        number = log._log_no
        monkeypatch.setattr(changelog, "COMPACT_MIN_BYTES", 0)
        log.base_bytes = 0  # the log outgrew the base: the next record starts a compaction
        await layer.lease("n1", 1)
        await _until(lambda: log._log_no == number + 1)  # the compaction opened the next log file
        monkeypatch.setattr(changelog, "COMPACT_MIN_BYTES", 1 << 40)
        held.release.set()
        await asyncio.wait_for(first, 5)
        await layer.lease("n2", 1)
        await layer.durability.commit(sync=True)
        assert log._log_no == number + 1 and held.calls[-1] == [paths.snapshot.parent]
        await layer.close()

    asyncio.run(go())


@pytest.mark.timeout(60)
def test_a_commit_made_while_close_waits_is_written_not_left_hanging(tmp_path, monkeypatch):
    """A commit that arrives as ``close``'s wait for an in-flight fsync ends is written and
    answered before the log closes; a record flushed after the close fails its waiters."""
    held = _HeldSync(monkeypatch)
    paths = Paths(tmp_path)
    layer = paths.layer()
    log = layer.durability.log
    real_gather, late = asyncio.gather, []

    async def gather_then_commit(*aws, **kw):  # a commit call arrives just as the wait ends
        out = await real_gather(*aws, **kw)
        if not late:
            late.append(asyncio.ensure_future(log.commit()))
            await asyncio.sleep(0)  # the commit is made (its record scheduled), not yet written
        return out

    async def go():
        await layer.lease("n0", 1)
        first = asyncio.ensure_future(layer.durability.commit(sync=True))
        await held.wait_started()
        monkeypatch.setattr(asyncio, "gather", gather_then_commit)
        closing = asyncio.ensure_future(log.close())
        await asyncio.sleep(0)
        held.release.set()
        await asyncio.wait_for(closing, 5)
        await asyncio.wait_for(first, 5)
        await asyncio.wait_for(late[0], 5)  # hangs when its record is flushed after the close
        monkeypatch.setattr(asyncio, "gather", real_gather)
        waiter = asyncio.get_running_loop().create_future()
        log._waiters, log._scheduled = [waiter], True
        log._flush()
        with pytest.raises(RuntimeError, match="change log is closed"):
            waiter.result()
        await layer.close()

    asyncio.run(go())
