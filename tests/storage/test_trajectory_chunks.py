"""Trajectory store: in-place chunk I/O, group commits, and segments written by Zarr itself.

Each test runs against the directory and the in-process backend where both apply.
"""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest
import zarr

import storage.trajectories.layout as layout
import storage.trajectories.writer as writer_mod
from storage import paths
from storage.atomic import create_atomically
from storage.trajectories import EntryNotCommitted, EntryRef, open_trajectory_store
from storage.trajectories.layout import FLAT_DTYPES, INDEX_COLUMNS, marker_record
from storage_workers import as_marker_layout, committed_refs, make_row, rows_equal


class _Crash(Exception):
    """Stands in for the writer's death between writing chunk data and creating markers."""


@pytest.fixture(params=["dir", "memory"])
def store_url(request, tmp_path):
    return str(tmp_path / "store") if request.param == "dir" else f"memory://chunks-{uuid.uuid4().hex}"


def test_ranges_across_many_small_chunks_read_back_through_the_store_and_zarr(store_url, monkeypatch):
    """Chunks of a few bytes: every batch, entry and array straddles chunk boundaries."""
    monkeypatch.setattr(writer_mod, "DATA_CHUNK", 64)
    store = open_trajectory_store(store_url)
    w = store.writer("seg", batch_size=3)
    rows = [make_row(1, i, length=[1, 15, 16, 17, 40, 2, 64, 5][i % 8]) for i in range(23)]
    refs = w.write(rows[:4]) + w.write(rows[4:5]) + w.write(rows[5:])
    order = np.random.default_rng(0).permutation(len(rows))
    got = open_trajectory_store(store_url, "r").read([refs[i] for i in order])
    assert all(rows_equal(rows[i], row) for i, row in zip(order, got))
    # a Zarr reader sees the packed batches in the ``data`` array, each array of a batch
    # after the one before it (the shape covers at least what is committed)
    group = zarr.open_group(store=store._backend.zarr_store("seg", read_only=True), mode="r", zarr_format=3)
    assert group["data"].chunks == (64,) and group["data"].dtype == np.uint8
    reader = open_trajectory_store(store_url, "r")
    at = 0
    for k in range(reader.batch_count("seg")):
        b = reader.batch("seg", k)
        mine = rows[b.start:b.end]
        offsets = layout.packed_offsets(len(mine), sum(len(r.tokens) for r in mine))
        for name in FLAT_DTYPES:
            flat = np.concatenate([getattr(r, name) for r in mine]).astype(FLAT_DTYPES[name])
            got_bytes = group["data"][at + offsets[name]:at + offsets[name] + flat.nbytes]
            assert got_bytes.tobytes() == flat.tobytes(), (k, name)
        got_index = group["data"][at + offsets["index"]:at + offsets["reward"]].view(np.int64)
        assert got_index.reshape(-1, len(INDEX_COLUMNS))[:, 1].tolist() == [len(r.tokens) for r in mine]
        assert group["data"][at + offsets["reward"]:at + offsets[""]].view(np.float64).tolist() == \
            [r.reward for r in mine]
        at += offsets[""]


def test_one_write_commits_its_batches_together_or_not_at_all(store_url):
    store = open_trajectory_store(store_url)
    w = store.writer("seg", batch_size=4)
    w.write([make_row(2, i) for i in range(3)])

    def crash() -> None:
        raise _Crash()

    w._before_commit = crash  # every batch's chunk data is written, no log record exists yet
    with pytest.raises(_Crash):
        w.write([make_row(2, i) for i in range(3, 13)])
    reader = open_trajectory_store(store_url, "r")
    assert reader.count("seg") == 3 and reader.batch_count("seg") == 1
    with pytest.raises(EntryNotCommitted):
        reader.read([EntryRef("seg", 3)])
    w2 = store.writer("seg", batch_size=4)  # a successor continues after the last marker
    refs = w2.write([make_row(3, i) for i in range(10)])
    assert [r.index for r in refs] == list(range(3, 13))
    assert [reader.batch("seg", k).start for k in range(reader.batch_count("seg"))] == [0, 3, 7, 11]
    assert reader.batch("seg", 3).end == 13
    got = reader.read(committed_refs(reader))
    assert [r.task_id for r in got] == [f"w2/t{i}" for i in range(3)] + [f"w3/t{i}" for i in range(10)]
    assert all(rows_equal(make_row(3, k), got[3 + k]) for k in range(10))


def test_markers_after_a_gap_are_not_committed_and_a_new_writer_removes_them(tmp_path):
    """A segment written before the commit log: a machine crash during a group commit may keep
    a later marker's link and lose an earlier one. Readers stop at the gap; the next writer
    removes the later markers and continues in the commit log."""
    root = tmp_path / "store"
    store = open_trajectory_store(str(root))
    store.writer("seg", batch_size=2).write([make_row(4, i) for i in range(6)])
    as_marker_layout(root, "seg")
    paths.commit_marker(root, "seg", 1).unlink()  # the lost link
    reader = open_trajectory_store(str(root), "r")
    assert reader.count("seg") == 2 and reader.batch_count("seg") == 1
    refs = open_trajectory_store(str(root)).writer("seg", batch_size=2).write([make_row(5, i) for i in range(3)])
    assert [r.index for r in refs] == [2, 3, 4]
    assert sorted(p.name for p in paths.segment_commit_dir(root, "seg").iterdir()) == [
        paths.commit_marker(root, "seg", 0).name, paths.commit_log(root, "seg").name]
    again = open_trajectory_store(str(root), "r")
    got = again.read([EntryRef("seg", i) for i in range(5)])
    assert [r.task_id for r in got] == ["w4/t0", "w4/t1", "w5/t0", "w5/t1", "w5/t2"]
    assert [again.batch("seg", k).start for k in range(again.batch_count("seg"))] == [0, 2, 4]


def _write_segment_through_zarr(root, segment: str, rows, chunk_bytes: int, compressors=None) -> None:
    """A segment as the store's writer made it before it wrote chunks in place: Zarr's own
    setitem per array (128 KiB chunks), then one commit marker."""
    group = zarr.open_group(store=zarr.storage.LocalStore(paths.segment_data_dir(root, segment)), mode="a",
                            zarr_format=3)
    lengths = [len(r.tokens) for r in rows]
    for k, dt in FLAT_DTYPES.items():
        flat = np.concatenate([getattr(r, k) for r in rows]).astype(dt)
        arr = group.create_array(k, shape=(len(flat),), chunks=(chunk_bytes // dt.itemsize,), dtype=dt,
                                 compressors=compressors, fill_value=0)
        arr[:] = flat
    index = np.array([[sum(lengths[:i]), n, r.seq_index, r.num_sequences]
                      for i, (n, r) in enumerate(zip(lengths, rows))])
    group.create_array("index", shape=index.shape, chunks=(2048, 4), dtype=np.int64, compressors=None,
                       fill_value=0)[:] = index
    group.create_array("reward", shape=(len(rows),), chunks=(16384,), dtype=np.float64, compressors=None,
                       fill_value=0.0)[:] = [r.reward for r in rows]
    paths.segment_commit_dir(root, segment).mkdir(parents=True)
    strings = {c: [getattr(r, c) for r in rows] for c in layout.STRING_COLUMNS}
    create_atomically(paths.commit_marker(root, segment, 0),
                      marker_record(0, (0, len(rows)), (0, sum(lengths)), strings))


def test_segment_written_by_zarr_is_read_and_continued(tmp_path):
    """A segment whose arrays Zarr wrote (each array of its own, 128 KiB chunks) reads back;
    its next writer goes on with packed batches, and reads span both layouts."""
    root = tmp_path / "store"
    open_trajectory_store(str(root))
    old = [make_row(6, i, length=300 + i) for i in range(40)]
    _write_segment_through_zarr(root, "old", old, 128 * 1024)
    store = open_trajectory_store(str(root))
    assert store.count("old") == 40
    assert all(rows_equal(a, b) for a, b in zip(old, store.read(committed_refs(store))))
    new = [make_row(7, i) for i in range(9)]
    refs = store.writer("old", batch_size=4).write(new)
    assert [r.index for r in refs] == list(range(40, 49))
    got = open_trajectory_store(str(root), "r").read([EntryRef("old", i) for i in range(49)])
    assert all(rows_equal(a, b) for a, b in zip(old + new, got))
    mixed = open_trajectory_store(str(root), "r").read_columns([EntryRef("old", i) for i in (48, 3, 39, 40, 41)])
    assert all(rows_equal(a, b) for a, b in zip([new[8], old[3], old[39], new[0], new[1]], mixed.rows()))
    tokens = zarr.open_array(store=zarr.storage.LocalStore(paths.segment_data_dir(root, "old")), path="tokens",
                             mode="r")
    assert tokens.chunks == (32 * 1024,)  # the old arrays are left as they were
    assert np.array_equal(tokens[:], np.concatenate([r.tokens for r in old]))


def test_compressed_segment_is_refused_with_a_clear_message(tmp_path):
    root = tmp_path / "store"
    open_trajectory_store(str(root))
    _write_segment_through_zarr(root, "zstd", [make_row(8, 0)], 128 * 1024,
                                compressors=[zarr.codecs.ZstdCodec()])
    store = open_trajectory_store(str(root))
    with pytest.raises(ValueError, match="not stored as uncompressed.*open this segment with Zarr"):
        store.read([EntryRef("zstd", 0)])
    json.loads(paths.commit_marker(root, "zstd", 0).read_bytes())  # the marker itself is fine
    # its writer packs new batches into an array of their own: they read back
    new = store.writer("zstd").write([make_row(8, 1)])
    assert rows_equal(make_row(8, 1), open_trajectory_store(str(root), "r").read(new)[0])


def test_scratch_store_without_fsync_reads_back_through_another_store_object(tmp_path):
    """``durable=False`` closes chunk files instead of syncing them before the markers appear."""
    url = str(tmp_path / "store")
    w = open_trajectory_store(url, durable=False).writer("seg", batch_size=3)
    rows = [make_row(9, i) for i in range(8)]
    refs = w.write(rows[:5]) + w.write(rows[5:])
    got = open_trajectory_store(url, "r").read(refs)
    assert all(rows_equal(a, b) for a, b in zip(rows, got))
    assert open_trajectory_store(url, "r").batch_count("seg") == 3  # 3 + 2, then 3


def test_a_commit_is_one_flush_round_of_data_and_log(tmp_path, monkeypatch):
    """A write is made durable by one flush round and nothing after it: a new segment's first
    commit flushes every chunk file, every ``zarr.json``, the commit log and every directory
    that gained an entry together; a later commit in the same chunks flushes only those chunks
    and the log."""
    import storage.trajectories.backends as backends

    calls: list[tuple[set[str], set[str]]] = []
    real = backends.sync_together

    def spy(data_files=(), full=()):
        data_files, full = list(data_files), list(full)
        calls.append(({os.readlink(f"/proc/self/fd/{f}") if isinstance(f, int) else str(f) for f in data_files},
                      {str(f) for f in full}))
        real(data_files, full)

    monkeypatch.setattr(backends, "sync_together", spy)
    monkeypatch.setattr(backends, "fsync_path", lambda p: calls.append(({str(p)}, {"fsync_path"})))
    root = tmp_path / "store"
    store = open_trajectory_store(str(root))
    w = store.writer("seg", batch_size=4)
    w.write([make_row(1, i) for i in range(6)])  # two batches, one record, one flush
    assert len(calls) == 1
    data_files, full = calls[0]
    data = paths.segment_data_dir(root, "seg")
    files = {str(p) for p in data.rglob("*") if p.is_file()}
    log = str(paths.commit_log(root, "seg"))
    assert data_files == files | {log}  # every chunk file, every zarr.json, the log
    dirs = {str(p) for p in data.rglob("*") if p.is_dir()} | {str(data)}
    assert dirs | {str(paths.segment_dir(root, "seg")), str(paths.segments_root(root)),
                   str(paths.segment_commit_dir(root, "seg"))} <= full
    calls.clear()
    w.write([make_row(1, 6)])
    (data_files, full), = calls
    assert data_files == {f for f in files if "/c/" in f} | {log} and not full


def _open_chunk_files(root) -> set[str]:
    data = str(root)
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(data) and "/c/" in target:
            out.add(target)
    return out


@pytest.mark.parametrize("durable", [True, False])
def test_chunk_files_stay_open_only_while_their_writer_may_use_them(tmp_path, durable):
    """Durable: a writer's chunk files stay open across commits and close with the writer.
    Scratch (``durable=False``): closed at every commit (on NFS, close is what flushes them)."""
    root = tmp_path / "store"
    store = open_trajectory_store(str(root), durable=durable)
    w = store.writer("seg", batch_size=4)
    w.write([make_row(1, i) for i in range(6)])
    w.write([make_row(1, i) for i in range(6, 9)])
    assert bool(_open_chunk_files(root)) == durable
    w.close()
    assert not _open_chunk_files(root)
    reader = open_trajectory_store(str(root), "r")
    assert all(rows_equal(make_row(1, i), r) for i, r in enumerate(reader.read(committed_refs(reader))))


def test_a_batch_with_mismatched_arrays_is_refused_naming_the_entry(store_url):
    w = open_trajectory_store(store_url).writer("seg")
    good = make_row(0, 0, length=5)
    short = make_row(0, 1, length=5)
    object.__setattr__(short, "logprobs", short.logprobs[:3])
    with pytest.raises(ValueError, match="'w0/t1': logprobs has shape \\(3,\\)"):
        w.write([good, short])
    flat = make_row(0, 2, length=4)
    object.__setattr__(flat, "versions", flat.versions.reshape(2, 2))
    with pytest.raises(ValueError, match="'w0/t2': versions has shape \\(2, 2\\)"):
        w.write([flat])
    wide = make_row(0, 3, length=2)
    object.__setattr__(wide, "policy_ids", np.array([1, 70000]))
    with pytest.raises(ValueError, match="policy_ids values do not fit"):
        w.write([wide])
    assert w.write([good])[0].index == 0  # nothing of the refused batches was committed


def test_writers_of_one_store_write_at_the_same_time_from_threads(tmp_path, monkeypatch):
    """Each writer keeps its own chunk files open: one closing its oldest never closes (or
    syncs, or writes through) a descriptor another writer is using."""
    import threading

    import storage.trajectories.backends as backends

    monkeypatch.setattr(writer_mod, "DATA_CHUNK", 64)  # many chunk files per segment
    monkeypatch.setattr(backends, "_MAX_OPEN", 2)  # and each writer closes its oldest often
    store = open_trajectory_store(str(tmp_path / "store"))
    rows = {n: [make_row(n, i, length=5 + (i * 7) % 40) for i in range(120)] for n in range(1, 5)}
    refs: dict[int, list] = {}
    errors: list[BaseException] = []

    def write(n: int) -> None:
        try:
            w = store.writer(f"seg{n}", batch_size=4)
            refs[n] = [ref for i in range(0, 120, 3) for ref in w.write(rows[n][i:i + 3])]
            w.close()
        except BaseException as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=write, args=(n,)) for n in rows]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    reader = open_trajectory_store(str(tmp_path / "store"), "r")
    for n, mine in rows.items():
        assert all(rows_equal(a, b) for a, b in zip(mine, reader.read(refs[n]), strict=True))
