"""One conformance suite for every trajectory-store backend.

A backend's test module subclasses ``TrajectoryStoreConformance`` and provides the ``store_url``
fixture (a fresh store per test); every behaviour the components rely on is checked here once.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import time

import hypothesis.strategies as st
import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.extra.numpy import arrays

from storage.trajectories import (
    EntryNotCommitted,
    EntryRef,
    StoredSequence,
    TrajectoryStore,
    open_trajectory_store,
)
from storage_workers import committed_refs, make_row, rows_equal, write_segment, write_then_hang


@st.composite
def stored_rows(draw) -> StoredSequence:
    n = draw(st.integers(1, 300))
    text = st.text(max_size=40)
    return StoredSequence(
        task_id=draw(text),
        group_id=draw(text),
        seq_index=draw(st.integers(0, 1000)),
        num_sequences=draw(st.integers(1, 1000)),
        tokens=draw(arrays(np.int32, n)),
        loss_mask=draw(arrays(np.bool_, n)),
        logprobs=draw(arrays(np.float32, n)),
        policy_ids=draw(arrays(np.int16, n)),
        versions=draw(arrays(np.int32, n)),
        reward=draw(st.floats(allow_nan=False)),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        meta=json.dumps({"m": draw(text)}, ensure_ascii=draw(st.booleans())),
    )


class _Crash(Exception):
    """Stands in for a process death inside one process (backends without multiprocess)."""


class TrajectoryStoreConformance:
    """Subclass per backend; provide ``store_url`` (a fresh, not yet created store)."""

    @pytest.fixture
    def make_store(self, store_url):
        def make(mode: str = "a") -> TrajectoryStore:
            return open_trajectory_store(store_url, mode)

        return make

    # -- round trip ---------------------------------------------------------------------------
    # every backend class runs the same examples: differing executors are intended here.
    @settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.differing_executors,
                                                                     HealthCheck.too_slow,
                                                                     HealthCheck.data_too_large])
    @given(rows=st.lists(stored_rows(), min_size=1, max_size=10), batch_size=st.integers(1, 8),
           seed=st.integers(0, 2**16))
    def test_round_trip_exactly_as_written(self, make_store, rows, batch_size, seed):
        store = make_store()
        segment = f"s{len(store.segments())}"
        refs = store.writer(segment, batch_size=batch_size).write(rows)
        assert [r.index for r in refs] == list(range(len(rows)))
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        got = store.read([refs[i] for i in order])
        for i, row in zip(order, got):
            assert rows_equal(rows[i], row), i
            assert row.tokens.dtype == np.int32 and row.policy_ids.dtype == np.int16
        assert open_trajectory_store(store.url, "r").count(segment) == len(rows)

    # -- counting what is committed -----------------------------------------------------------
    def test_count_follows_every_commit_of_every_segment(self, make_store):
        store = make_store()
        reader = make_store("r")
        a, b = store.writer("a", batch_size=5), store.writer("b", batch_size=7)
        written: list[EntryRef] = []
        for step in range(4):
            written += a.write([make_row(1, 10 * step + i) for i in range(3 + step)])
            if step % 2:
                written += b.write([make_row(2, 10 * step + i) for i in range(11)])
            assert {s: reader.count(s) for s in reader.segments()} == {"a": a.committed, "b": b.committed}
        assert committed_refs(reader) == sorted(written, key=lambda r: (r.segment, r.index))
        assert store.segments() == ["a", "b"] and reader.count("unknown") == 0

    def test_reopen_continues_after_the_last_commit(self, make_store):
        store = make_store()
        store.writer("seg", batch_size=4).write([make_row(3, i) for i in range(10)])
        del store
        # "restart": a new store object and a new writer for the same segment
        store2 = make_store()
        w = store2.writer("seg", batch_size=4)
        assert w.committed == 10
        refs = w.write([make_row(3, i) for i in range(10, 15)])
        assert [r.index for r in refs] == [10, 11, 12, 13, 14]
        reader = make_store("r")
        assert committed_refs(reader) == [EntryRef("seg", i) for i in range(15)]
        assert [r.task_id for r in reader.read(committed_refs(reader))] == [f"w3/t{i}" for i in range(15)]
        assert all(rows_equal(make_row(3, 10 + k), r) for k, r in enumerate(store2.read(refs)))

    def test_read_rejects_uncommitted_and_bad_names(self, make_store):
        store = make_store()
        store.writer("seg").write([make_row(0, 0)])
        with pytest.raises(EntryNotCommitted, match="committed"):
            store.read([EntryRef("seg", 1)])
        with pytest.raises(ValueError, match="path component"):
            store.writer("../evil")
        with pytest.raises(ValueError, match="mode='a'"):
            make_store("r").writer("other")

    # -- concurrency --------------------------------------------------------------------------
    @pytest.mark.timeout(120)
    def test_concurrent_writer_processes_lose_and_tear_nothing(self, make_store, store_url):
        store = make_store()
        if not store.supports_multiprocess:
            pytest.skip("backend is in-process only")
        n, writers = 150, 3
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=write_segment, args=(store_url, w, n, [1, 7, 16, 33, 3])) for w in range(writers)]
        for p in procs:
            p.start()
        # read what is committed while the writers go on, as the data layer does (count, read)
        seen = {f"w{w}": 0 for w in range(writers)}
        deadline = time.monotonic() + 90
        try:
            while sum(seen.values()) < n * writers:
                assert time.monotonic() < deadline, f"saw {seen} of {n} entries per writer before the deadline"
                new = [EntryRef(s, i) for s in seen for i in range(seen[s], store.count(s))]
                for ref, row in zip(new, store.read(new)):
                    assert ref.index == seen[ref.segment], f"{ref} out of order"
                    seen[ref.segment] += 1
                    w = int(ref.segment[1:])
                    assert rows_equal(make_row(w, ref.index), row), f"torn entry {ref}"
                if not new:
                    time.sleep(0.02)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
                    p.join()
        assert [p.exitcode for p in procs] == [0] * writers
        assert {s: store.count(s) for s in store.segments()} == {f"w{w}": n for w in range(writers)}

    @pytest.mark.timeout(120)
    def test_killed_writer_leaves_nothing_visible_and_segment_continues(self, make_store, store_url, tmp_path):
        store = make_store()
        first, second, batch = 5, 9, 4  # the killed write is three batches, none may show
        if store.supports_multiprocess:
            ready = tmp_path / "ready"
            p = mp.get_context("spawn").Process(target=write_then_hang,
                                                args=(store_url, "seg", first, second, str(ready), batch))
            p.start()
            deadline = time.monotonic() + 60
            while not ready.exists():
                assert p.is_alive() and time.monotonic() < deadline, "child did not reach the hook"
                time.sleep(0.02)
            os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=30)
            assert p.exitcode == -signal.SIGKILL
        else:
            w = store.writer("seg", batch_size=batch)
            w.write([make_row(0, i) for i in range(first)])

            def crash() -> None:
                raise _Crash()

            w._before_commit = crash
            with pytest.raises(_Crash):
                w.write([make_row(0, i) for i in range(first, first + second)])
        # the orphaned batches' bytes were written (the first one's tokens lead it, right after
        # the committed bytes), but nothing of them is visible
        data = zarr.open_array(store=store._backend.zarr_store("seg", read_only=True), path="data", mode="r")
        view = make_store("r")._view("seg")
        view.refresh()
        orphan = np.concatenate([make_row(0, i).tokens for i in range(first, first + min(batch, second))])
        assert np.array_equal(data[view.data_end:view.data_end + orphan.nbytes].view(np.int32), orphan)
        assert make_store("r").count("seg") == first and make_store("r").batch_count("seg") == 2
        with pytest.raises(EntryNotCommitted):
            make_store("r").read([EntryRef("seg", first)])
        # reopening continues after the last committed entry and overwrites the orphaned data
        w2 = make_store().writer("seg", batch_size=4)
        refs = w2.write([make_row(5, i, length=37) for i in range(6)])
        assert [r.index for r in refs] == list(range(first, first + 6))
        reader = make_store("r")
        assert committed_refs(reader)[first:] == refs
        got = reader.read([EntryRef("seg", i) for i in range(first + 6)])
        assert all(rows_equal(make_row(0, i), got[i]) for i in range(first))
        assert all(rows_equal(make_row(5, k, length=37), got[first + k]) for k in range(6))

    # -- errors -------------------------------------------------------------------------------
    def test_missing_store_in_read_mode(self, store_url):
        with pytest.raises(FileNotFoundError, match="mode='a'"):
            open_trajectory_store(store_url, "r")

    def test_bad_mode(self, store_url):
        with pytest.raises(ValueError, match="mode must be"):
            open_trajectory_store(store_url, "w")
