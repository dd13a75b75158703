"""Trajectory store: the column-wise read (``read_columns``) against the row API, on every backend."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

import storage.trajectories.layout as layout
import storage.trajectories.reader as reader_mod
import storage.trajectories.writer as writer_mod
from storage.trajectories import EntryNotCommitted, EntryRef, open_trajectory_store
from storage.trajectories.layout import FLAT_DTYPES
from storage_workers import make_row, rows_equal


@pytest.fixture(params=["dir", "memory"])
def store_url(request, tmp_path):
    return str(tmp_path / "store") if request.param == "dir" else f"memory://columns-{uuid.uuid4().hex}"


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few elements and a small merge gap: entries straddle chunk boundaries, and
    reads take both paths (straight into the columns, and through a merged run)."""
    monkeypatch.setattr(writer_mod, "DATA_CHUNK", 64)  # 16 tokens per chunk
    monkeypatch.setattr(layout, "CHUNK_BYTES", 64)  # the same for segments rewritten as before packing
    monkeypatch.setattr(reader_mod, "_MERGE_GAP_TOKENS", 20)


def _write_two_segments(url: str) -> dict[EntryRef, object]:
    store = open_trajectory_store(url)
    written = {}
    for seg, w_id in (("a", 1), ("b", 2)):
        w = store.writer(seg, batch_size=3)
        rows = [make_row(w_id, i, length=[1, 15, 16, 17, 40, 0, 64, 5, 33][i % 9]) for i in range(29)]
        refs = w.write(rows[:4]) + w.write(rows[4:5]) + w.write(rows[5:])
        written.update(zip(refs, rows))
    return written


def _check_columns_equal_rows(cols, rows, refs) -> None:
    assert cols.refs == refs and len(cols) == len(refs)
    assert cols.offsets[0] == 0 and cols.lengths.tolist() == [len(r.tokens) for r in rows]
    for k, dt in FLAT_DTYPES.items():
        col = getattr(cols, k)
        assert col.dtype == dt and col.ndim == 1
        assert np.array_equal(col, np.concatenate([getattr(r, k) for r in rows]).astype(dt), equal_nan=True), k
    assert cols.seq_index.tolist() == [r.seq_index for r in rows]
    assert cols.num_sequences.tolist() == [r.num_sequences for r in rows]
    assert cols.reward.tolist() == [r.reward for r in rows]
    for c in ("task_id", "group_id", "finish_reason", "meta"):
        assert getattr(cols, c) == [getattr(r, c) for r in rows], c
    assert all(rows_equal(a, b) for a, b in zip(cols.rows(), rows))
    assert all(rows_equal(cols.row(i, copy=True), r) for i, r in enumerate(rows))


@pytest.mark.parametrize("order", ["in order", "shuffled", "runs and repeats"])
def test_columns_equal_the_row_api_across_segments_and_chunks(store_url, small_chunks, order):
    written = _write_two_segments(store_url)
    refs = list(written)
    if order == "shuffled":
        refs = [refs[i] for i in np.random.default_rng(3).permutation(len(refs))]
    elif order == "runs and repeats":  # stretches of consecutive entries, a gap, a repeat, back again
        a = [r for r in refs if r.segment == "a"]
        b = [r for r in refs if r.segment == "b"]
        refs = a[20:26] + b[0:7] + a[2:5] + a[2:3] + b[28:29] + a[0:1] + b[10:18]
    store = open_trajectory_store(store_url, "r")
    cols = store.read_columns(refs)
    rows = store.read(refs)
    assert all(rows_equal(written[r], row) for r, row in zip(refs, rows))
    _check_columns_equal_rows(cols, rows, refs)


def test_padded_and_split_give_each_entry_its_own_tokens(store_url):
    store = open_trajectory_store(store_url)
    rows = [make_row(4, i, length=n) for i, n in enumerate([3, 0, 7, 1])]
    cols = store.read_columns(store.writer("s").write(rows))
    pad = cols.padded("tokens", pad=-1)
    assert pad.shape == (4, 7) and pad.dtype == np.int32
    for i, r in enumerate(rows):
        assert pad[i, :len(r.tokens)].tolist() == r.tokens.tolist()
        assert (pad[i, len(r.tokens):] == -1).all()
        assert np.array_equal(cols.split("logprobs")[i], r.logprobs)
    assert cols.padded("loss_mask", width=9).shape == (4, 9)
    with pytest.raises(ValueError, match="longest entry"):
        cols.padded("tokens", width=2)
    with pytest.raises(ValueError, match="per-token column"):
        cols.split("reward")


def test_reading_no_refs_gives_empty_columns(store_url):
    store = open_trajectory_store(store_url)
    cols = store.read_columns([])
    assert len(cols) == 0 and cols.offsets.tolist() == [0] and cols.rows() == [] and store.read([]) == []
    assert all(getattr(cols, k).dtype == dt and len(getattr(cols, k)) == 0 for k, dt in FLAT_DTYPES.items())
    assert cols.padded("tokens").shape == (0, 0)


def test_an_uncommitted_or_unknown_ref_fails_naming_it(store_url):
    store = open_trajectory_store(store_url)
    refs = store.writer("seg", batch_size=2).write([make_row(0, i) for i in range(3)])
    for bad in (EntryRef("seg", 3), EntryRef("seg", -1), EntryRef("nowhere", 0)):
        with pytest.raises(EntryNotCommitted, match=f"{bad.segment}:{bad.index}"):
            store.read_columns(refs + [bad])
        with pytest.raises(EntryNotCommitted, match=f"{bad.segment}:{bad.index}"):
            store.read([bad])


def test_columns_span_batches_written_before_packing_and_after(tmp_path, small_chunks):
    """A segment rewritten as writers wrote it before packing (each array of its own), then
    continued with packed batches: one read of entries on both sides of the change, in any
    order, equals what was written."""
    from storage_workers import as_per_array_layout

    url = str(tmp_path / "store")
    written = _write_two_segments(url)
    as_per_array_layout(url, "a")
    w = open_trajectory_store(url).writer("a", batch_size=3)
    more = [make_row(5, i, length=[2, 30, 16][i % 3]) for i in range(8)]
    written.update(zip(w.write(more[:5]) + w.write(more[5:]), more))
    refs = [written_ref for written_ref in written]
    refs = [refs[i] for i in np.random.default_rng(4).permutation(len(refs))] + refs[20:40]
    store = open_trajectory_store(url, "r")
    rows = [written[r] for r in refs]
    _check_columns_equal_rows(store.read_columns(refs), rows, refs)


def test_far_apart_refs_read_the_same_rows_as_near_ones(tmp_path, monkeypatch):
    """Refs far apart in one segment are read a run at a time: the same rows, in the order asked."""
    monkeypatch.setattr(reader_mod, "_MERGE_GAP_ENTRIES", 3)
    store = open_trajectory_store(str(tmp_path / "s"))
    w = store.writer("a", batch_size=8)
    refs = w.write([_far_row(i) for i in range(40)])
    w.close()
    asked = [refs[i] for i in (39, 0, 1, 20, 38, 2, 21, 0)]
    got = store.read(asked)
    assert [r.task_id for r in got] == [f"t{i}" for i in (39, 0, 1, 20, 38, 2, 21, 0)]
    assert [float(r.reward) for r in got] == [float(i) for i in (39, 0, 1, 20, 38, 2, 21, 0)]


def _far_row(i: int):
    from storage.trajectories import StoredSequence

    z = np.full(i % 3 + 1, i, np.int32)
    return StoredSequence(f"t{i}", "g", 0, 1, z, np.ones(len(z), np.uint8), z.astype(np.float32),
                          z.astype(np.int16), z, float(i), "stop", "")
