"""Trajectory store: packed batches next to batches written before packing, in one segment.

A segment written before packing (each array in an array of its own) is continued with packed
batches, so reads map a row range across both layouts and across packed batches. These tests
write random batches (entries without tokens included) with chunks of a few bytes, convert a
segment at a random point, continue it, and check many random reads against what was written;
and they make the commit log states where the two layouts meet: the first record of a
segment written before packing checked from another boot, a per-array record after packed
ones, a write killed between its packed bytes and its record.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import storage.trajectories.layout as layout
import storage.trajectories.reader as reader_mod
import storage.trajectories.segment_view as segment_view
import storage.trajectories.writer as writer_mod
from storage import paths
from storage.trajectories import EntryNotCommitted, EntryRef, open_trajectory_store
from storage.trajectories.layout import BOOT_ID, CRC_ORDER, FLAT_DTYPES, log_record, parse_log
from storage_workers import as_per_array_layout, make_row, rows_equal


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few rows and a small merge gap (as in ``test_trajectory_columns``): batches
    and entries straddle chunk boundaries, and reads take both the direct and the merged path."""
    monkeypatch.setattr(writer_mod, "DATA_CHUNK", 64)
    monkeypatch.setattr(layout, "CHUNK_BYTES", 64)
    monkeypatch.setattr(reader_mod, "_MERGE_GAP_TOKENS", 20)


class Written:
    """What a test wrote to one segment: its rows and its batches' entry ranges, in order."""

    def __init__(self, writer_id: int):
        self.writer_id = writer_id
        self.rows: list = []
        self.batches: list[tuple[int, int]] = []

    def write(self, w, lengths: list[int]) -> None:
        rows = [make_row(self.writer_id, len(self.rows) + k, length=n) for k, n in enumerate(lengths)]
        refs = w.write(rows)
        assert [r.index for r in refs] == list(range(len(self.rows), len(self.rows) + len(rows)))
        for i in range(0, len(rows), w.batch_size):
            self.batches.append((len(self.rows) + i, len(self.rows) + min(i + w.batch_size, len(rows))))
        self.rows += rows

    def array(self, name: str) -> np.ndarray:
        """The segment's whole array ``name`` as written (per-token arrays concatenated)."""
        if name in FLAT_DTYPES:
            return np.concatenate([np.asarray(getattr(r, name), FLAT_DTYPES[name]) for r in self.rows])
        if name == "reward":
            return np.array([r.reward for r in self.rows], np.float64)
        lengths = np.array([len(r.tokens) for r in self.rows], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        return np.stack([offsets, lengths, [r.seq_index for r in self.rows],
                         [r.num_sequences for r in self.rows]], axis=1).astype(np.int64)


def _random_lengths(rng, n: int) -> list[int]:
    """Entry lengths: about a third without tokens, the others up to a few chunks long."""
    return [0 if rng.random() < 0.3 else int(rng.integers(1, 40)) for _ in range(n)]


def _boundaries(segment: Written, name: str) -> list[int]:
    """Row numbers of array ``name`` where a batch starts or ends."""
    if name not in FLAT_DTYPES:
        return sorted({b for pair in segment.batches for b in pair})
    tok = np.concatenate([[0], np.cumsum([len(r.tokens) for r in segment.rows])])
    return sorted({int(tok[b]) for pair in segment.batches for b in pair})


def _check_reads(store, segs: dict[str, Written], rng, rounds: int) -> None:
    """Random reads of ``store`` against what was written: row ranges of every array (ends
    often on batch boundaries), ``read_columns``/``read`` of runs, samples and repeats across
    the segments, and every batch."""
    whole = {s: {name: w.array(name) for name in CRC_ORDER} for s, w in segs.items()}
    for s, w in segs.items():
        view = store._view(s)
        view.refresh()
        assert view.committed == len(w.rows) and [(m.start, m.end) for m in view.markers] == w.batches
        for name in CRC_ORDER:
            edges, total = _boundaries(w, name), len(whole[s][name])
            for _ in range(rounds):
                a, b = sorted(int(rng.choice(edges)) if rng.random() < 0.5 else int(rng.integers(0, total + 1))
                              for _ in range(2))
                assert np.array_equal(view.rows(name, a, b), whole[s][name][a:b]), (s, name, a, b)
        for k, (start, end) in enumerate(w.batches):
            got = store.batch(s, k)
            assert (got.start, got.end) == (start, end)
            assert np.array_equal(got.index, whole[s]["index"][start:end])
            assert np.array_equal(got.rewards, whole[s]["reward"][start:end])
            assert got.strings["task_id"] == [r.task_id for r in w.rows[start:end]]
    everything = [EntryRef(s, i) for s, w in segs.items() for i in range(len(w.rows))]
    for _ in range(rounds):
        kind = rng.integers(3)
        if kind == 0:  # one run of consecutive entries
            s = str(rng.choice(list(segs)))
            a, b = sorted(rng.integers(0, len(segs[s].rows) + 1, 2).tolist())
            refs = [EntryRef(s, i) for i in range(a, max(b, a + 1)) if i < len(segs[s].rows)]
        elif kind == 1:  # a sample with repeats, in any order
            refs = [everything[i] for i in rng.integers(0, len(everything), int(rng.integers(1, 30)))]
        else:  # runs of both segments, interleaved
            refs = [everything[i] for i in range(len(everything)) if rng.random() < 0.5]
            refs = [refs[i] for i in rng.permutation(len(refs))] if rng.random() < 0.5 else refs
        rows = [segs[r.segment].rows[r.index] for r in refs]
        cols = store.read_columns(refs)
        assert cols.refs == refs and cols.lengths.tolist() == [len(r.tokens) for r in rows]
        for name, dt in FLAT_DTYPES.items():
            want = np.concatenate([np.asarray(getattr(r, name), dt) for r in rows]) if rows else np.zeros(0, dt)
            assert np.array_equal(getattr(cols, name), want), name
        assert cols.reward.tolist() == [r.reward for r in rows] and cols.meta == [r.meta for r in rows]
        assert all(rows_equal(a, b) for a, b in zip(store.read(refs), rows))


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_read_back_across_the_change_of_layout(tmp_path, monkeypatch, small_chunks, seed):
    """Random writes to a segment, converted to the layout before packing at a random point and
    continued packed, next to a segment written packed throughout: every random read equals
    what was written, for a reader opened before the segment was continued, a fresh one, and
    one on another machine (which checks each last record's bytes against its crc)."""
    rng = np.random.default_rng(seed)
    url = str(tmp_path / "store")
    store = open_trajectory_store(url)
    segs = {"mixed": Written(1), "packed": Written(2)}
    writes = int(rng.integers(4, 9))
    convert_after = int(rng.integers(1, writes))
    writers = {s: store.writer(s, batch_size=int(rng.integers(1, 6))) for s in segs}
    early, per_array = None, 0
    for k in range(writes):
        if k == convert_after:
            per_array = len(segs["mixed"].batches)
            writers["mixed"].close()
            as_per_array_layout(url, "mixed")
            early = open_trajectory_store(url, "r")
            _check_reads(early, segs, rng, rounds=5)  # its views now know the per-array batches
            writers["mixed"] = open_trajectory_store(url).writer("mixed", batch_size=int(rng.integers(1, 6)))
        for s, w in writers.items():
            segs[s].write(w, _random_lengths(rng, int(rng.integers(1, 10))))
    for w in writers.values():
        w.close()
    mixed = open_trajectory_store(url, "r")._view("mixed")
    mixed.refresh()
    assert 0 < mixed.first_packed == per_array < len(mixed.markers) and mixed.markers[per_array].data_at == 0
    _check_reads(early, segs, rng, rounds=20)
    _check_reads(open_trajectory_store(url, "r"), segs, rng, rounds=20)
    monkeypatch.setattr(segment_view, "BOOT_ID", "another-machine")
    _check_reads(open_trajectory_store(url, "r"), segs, rng, rounds=5)


@pytest.mark.parametrize("seed", range(3))
def test_random_packed_batches_read_back_from_a_memory_store(small_chunks, seed):
    """The memory backend (packed batches only: nothing there is written before packing) under
    the same random writes and reads."""
    rng = np.random.default_rng(100 + seed)
    store = open_trajectory_store(f"memory://packed-layout-{seed}-{rng.integers(1 << 62)}")
    segs = {"a": Written(1), "b": Written(2)}
    writers = {s: store.writer(s, batch_size=int(rng.integers(1, 6))) for s in segs}
    for _ in range(int(rng.integers(3, 8))):
        for s, w in writers.items():
            segs[s].write(w, _random_lengths(rng, int(rng.integers(1, 10))))
    _check_reads(store, segs, rng, rounds=30)


def _as_one_record_of_an_earlier_boot(root, segment: str) -> None:
    """Rewrite ``segment``'s commit log as a single record naming all its batches, written in an
    earlier boot (as one write of code before packing leaves it after a reboot)."""
    log = paths.commit_log(root, segment)
    batches = [m for _, listed in parse_log(log.read_bytes(), None) for m in listed]
    log.write_bytes(log_record([replace(m, boot="an-earlier-boot") for m in batches]))


@pytest.mark.parametrize("rows", [1, 5])
def test_the_first_record_of_a_segment_written_before_packing_is_checked_and_served(tmp_path, rows):
    """A segment written before packing whose only record is its first, read on another boot:
    its bytes are checked in the per-array arrays (no batch is known yet, none is packed), its
    entries are served, and the next writer continues after them instead of cutting them off."""
    root = tmp_path / "store"
    written = Written(1)
    written.write(open_trajectory_store(str(root)).writer("seg", batch_size=2), [3, 0, 17, 40, 9][:rows])
    as_per_array_layout(root, "seg")
    _as_one_record_of_an_earlier_boot(root, "seg")
    store = open_trajectory_store(str(root), "r")
    assert store.count("seg") == rows
    assert all(rows_equal(a, b) for a, b in zip(store.read([EntryRef("seg", i) for i in range(rows)]), written.rows))
    w = open_trajectory_store(str(root)).writer("seg", batch_size=2)
    assert w.committed == rows
    written.write(w, [4, 0, 11])
    _check_reads(open_trajectory_store(str(root), "r"), {"seg": written}, np.random.default_rng(0), rounds=10)


def test_a_per_array_record_after_packed_batches_ends_what_is_committed(tmp_path):
    """A record naming no packed bytes after packed batches (what code before packing appends
    to a segment it took over) does not continue them: reading it would look for the packed
    batches' rows in arrays of their own. Readers stop before it; the next writer cuts it off."""
    root = tmp_path / "store"
    written = Written(1)
    written.write(open_trajectory_store(str(root)).writer("seg", batch_size=2), [5, 0, 8])
    log = paths.commit_log(root, "seg")
    last = parse_log(log.read_bytes(), None)[-1][1][-1]
    with open(log, "ab") as f:
        f.write(log_record([replace(last, seqno=last.seqno + 1, start=3, end=4, tok_start=last.tok_end,
                                    tok_end=last.tok_end + 6, strings={k: v[:1] for k, v in last.strings.items()},
                                    boot=BOOT_ID, data_at=-1)]))
    assert len(parse_log(log.read_bytes(), None)) == 1
    store = open_trajectory_store(str(root), "r")
    assert store.count("seg") == 3
    assert all(rows_equal(a, b) for a, b in zip(store.read([EntryRef("seg", i) for i in range(3)]), written.rows))
    with pytest.raises(EntryNotCommitted):
        store.read([EntryRef("seg", 3)])
    written.write(open_trajectory_store(str(root)).writer("seg", batch_size=2), [2, 7])
    _check_reads(open_trajectory_store(str(root), "r"), {"seg": written}, np.random.default_rng(1), rounds=10)


def test_a_write_killed_before_its_record_in_a_converted_segment_leaves_nothing(tmp_path, small_chunks):
    """The first packed write of a segment written before packing stops after its bytes and
    before its record: nothing of it is served, and the next writer writes its packed batches
    from the start of ``data`` over the orphaned bytes."""
    root = tmp_path / "store"
    written = Written(1)
    written.write(open_trajectory_store(str(root)).writer("seg", batch_size=3), [6, 0, 30, 2, 9])
    as_per_array_layout(root, "seg")
    w = open_trajectory_store(str(root)).writer("seg", batch_size=2)

    def killed() -> None:
        raise RuntimeError("killed between the data and the record")

    w._before_commit = killed
    with pytest.raises(RuntimeError, match="killed"):
        w.write([make_row(9, i, length=20) for i in range(4)])
    assert (paths.segment_data_dir(root, "seg") / "data" / "c" / "0").stat().st_size > 0
    assert open_trajectory_store(str(root), "r").count("seg") == 5
    written.write(open_trajectory_store(str(root)).writer("seg", batch_size=2), [3, 0, 25])
    store = open_trajectory_store(str(root), "r")
    view = store._view("seg")
    view.refresh()
    assert view.first_packed == written.batches.index((5, 7)) == 2 and view.markers[2].data_at == 0
    _check_reads(store, {"seg": written}, np.random.default_rng(2), rounds=10)


def test_a_reader_of_the_per_array_layout_only_stops_at_the_first_packed_record(tmp_path):
    """Code written before packing accepts only the per-array records' magic: a log that goes
    on with packed batches ends, for it, where the per-array records end."""
    root = tmp_path / "store"
    open_trajectory_store(str(root)).writer("seg", batch_size=2).write([make_row(1, i) for i in range(4)])
    as_per_array_layout(root, "seg")
    open_trajectory_store(str(root)).writer("seg", batch_size=2).write([make_row(2, i) for i in range(3)])
    data = paths.commit_log(root, "seg").read_bytes()
    records = layout.parse_log(data, None)
    assert [[m.packed for m in batches] for _, batches in records] == [[False], [False], [True, True]]
    old_magic = [end for end, batches in records if not batches[0].packed]
    assert data[old_magic[-1]:old_magic[-1] + 4] == b"AFC4"  # what such code sees next: not its magic
    assert all(data[start:start + 4] == b"AFCL" for start in [0, *old_magic[:-1]])
