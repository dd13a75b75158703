"""Child-process bodies for the storage tests (importable by spawned processes).

Kept out of the test modules so that a spawned child imports only this file, numpy, zarr and
torch, not pytest's collection of the test module.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from storage.trajectories import EntryRef, SegmentWriter, StoredSequence, TrajectoryStore, open_trajectory_store


def make_row(writer: int, i: int, length: int | None = None) -> StoredSequence:
    """A deterministic entry: the reader regenerates it from (writer, i) to detect torn data."""
    rng = np.random.default_rng([writer, i])
    n = int(length if length is not None else rng.integers(1, 300))
    versions = rng.integers(-1, 50, n).astype(np.int32)
    return StoredSequence(
        task_id=f"w{writer}/t{i}",
        group_id=f"w{writer}/g{i // 4}",
        seq_index=i % 3,
        num_sequences=3,
        tokens=rng.integers(0, 2**31 - 1, n).astype(np.int32),
        loss_mask=(versions >= 0).astype(np.uint8),
        logprobs=rng.standard_normal(n).astype(np.float32),
        policy_ids=np.where(versions >= 0, rng.integers(0, 3, n), -1).astype(np.int16),
        versions=versions,
        reward=float(rng.standard_normal()),
        finish_reason=["stop", "length", "abort"][i % 3],
        meta=json.dumps({"writer": writer, "i": i, "note": "ünïcødé ✓"}),
    )


def committed_refs(store: TrajectoryStore) -> list[EntryRef]:
    """Every committed entry of the store, in segment then entry order."""
    return [EntryRef(s, i) for s in store.segments() for i in range(store.count(s))]


def rows_equal(a: StoredSequence, b: StoredSequence) -> bool:
    return (
        all(np.array_equal(getattr(a, k), getattr(b, k), equal_nan=(k == "logprobs"))
            for k in ("tokens", "loss_mask", "logprobs", "policy_ids", "versions"))
        and all(getattr(a, k) == getattr(b, k)
                for k in ("task_id", "group_id", "seq_index", "num_sequences", "reward", "finish_reason", "meta"))
    )


def write_segment(url: str, writer: int, n: int, batch_sizes: list[int]) -> None:
    """Write entries 0..n-1 of ``writer`` into segment ``w<writer>`` with varying call sizes."""
    store = open_trajectory_store(url)
    w = store.writer(f"w{writer}", batch_size=16)
    i = k = 0
    while i < n:
        step = min(batch_sizes[k % len(batch_sizes)], n - i)
        w.write([make_row(writer, j) for j in range(i, i + step)])
        i += step
        k += 1
    w.close()


def as_marker_layout(root, segment: str) -> None:
    """Rewrite ``segment`` as the store's writers wrote it before the commit log (layout 2)."""
    as_per_array_layout(root, segment, markers=True)


def as_per_array_layout(root, segment: str, markers: bool = False) -> None:
    """Rewrite what ``segment`` committed as the store's writers wrote it before packing: each
    array in a Zarr array of its own (``layout.CHUNK_BYTES`` chunks), the same batches, and
    either one commit marker per batch (``markers``: layout 2, before the commit log) or a
    commit log whose records name no packed bytes (layout 3); the store's layout file at that
    version."""
    from pathlib import Path

    import zarr

    from storage import paths
    from storage.atomic import create_atomically, write_json
    from storage.trajectories import layout

    root = Path(root)
    store = open_trajectory_store(str(root), "r")
    batches = [store.batch(segment, k) for k in range(store.batch_count(segment))]
    rows = store.read([EntryRef(segment, i) for i in range(store.count(segment))])
    data_dir = paths.segment_data_dir(root, segment)
    for path in sorted(data_dir.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    paths.commit_log(root, segment).unlink()
    group = zarr.open_group(store=zarr.storage.LocalStore(data_dir), mode="a", zarr_format=3)
    arrays = {k: np.concatenate([getattr(r, k) for r in rows]).astype(dt) for k, dt in layout.FLAT_DTYPES.items()}
    arrays["index"] = np.concatenate([b.index for b in batches])
    arrays["reward"] = np.concatenate([b.rewards for b in batches])
    for k, a in arrays.items():
        row = a.dtype.itemsize * int(np.prod(a.shape[1:]))  # a[:1] is empty where no entry has tokens
        group.create_array(k, shape=a.shape, chunks=(max(layout.CHUNK_BYTES // row, 1),) + a.shape[1:],
                           dtype=a.dtype, compressors=None, fill_value=0)[:] = a
    log = b""
    for b in batches:
        t0, t1 = int(b.index[0, 0]), int(b.index[-1, 0] + b.index[-1, 1])
        if markers:
            create_atomically(paths.commit_marker(root, segment, b.seqno),
                              layout.marker_record(b.seqno, (b.start, b.end), (t0, t1), b.strings))
            continue
        parts = [arrays[k][t0:t1] if k in layout.FLAT_DTYPES else arrays[k][b.start:b.end] for k in layout.CRC_ORDER]
        crc = layout.data_crc(memoryview(np.ascontiguousarray(p).reshape(-1).view(np.uint8)) for p in parts)
        log += layout.log_record([layout.Marker(b.seqno, b.start, b.end, t0, t1, b.strings, b.written_at, crc)])
    if not markers:
        paths.commit_log(root, segment).write_bytes(log)
    rec = json.loads(paths.store_layout_file(root).read_bytes())
    write_json(paths.store_layout_file(root), {**rec, "layout_version": 2 if markers else 3}, sort_keys=True)


def token_position(root, segment: str, seqno: int, token: int = 0) -> tuple[str, int]:
    """The chunk file of ``segment``'s packed ``data`` array, and the byte offset in it, that
    hold token ``token`` (counted from the batch's first) of committed batch ``seqno``."""
    from storage import paths
    from storage.trajectories import layout

    view = open_trajectory_store(str(root), "r")._view(segment)
    view.refresh()
    m = view.markers[seqno]
    chunk = json.loads((paths.segment_data_dir(root, segment) / layout.DATA_ARRAY / "zarr.json").read_bytes())
    size = chunk["chunk_grid"]["configuration"]["chunk_shape"][0]
    at = m.data_at + layout.packed_offsets(m.end - m.start, m.tok_end - m.tok_start)["tokens"] + 4 * token
    return str(paths.segment_data_dir(root, segment) / layout.DATA_ARRAY / "c" / str(at // size)), at % size


def write_then_hang(url: str, segment: str, first: int, second: int, ready_path: str, batch_size: int) -> None:
    """Commit ``first`` entries, then write ``second`` entries' chunk data (several batches when
    ``batch_size`` < ``second``) and hang before their log record (the parent SIGKILLs this
    process once ``ready_path`` exists)."""
    store = open_trajectory_store(url)
    w = store.writer(segment, batch_size=batch_size)
    w.write([make_row(0, i) for i in range(first)])

    def hang() -> None:
        with open(ready_path, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)

    SegmentWriter._before_commit = staticmethod(hang)
    w.write([make_row(0, i) for i in range(first, first + second)])


def dcp_rank(rank: int, world: int, pg_file: str, weights_root: str, policy: str, version: int) -> None:
    """One rank of a 2-rank trainer: a Shard(0) DTensor plus a rank-local tensor, saved by DCP
    into the weight store's staging directory over a gloo group."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from storage.weights import WeightStore

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = expected_full()
        state = {
            "layer.weight": distribute_tensor(full["layer.weight"], mesh, [Shard(0)]),
            f"rank{rank}.bias": full[f"rank{rank}.bias"],
        }
        dcp.save(state, checkpoint_id=WeightStore(weights_root).staging(policy, version))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def expected_full() -> dict:
    import torch

    g = torch.Generator().manual_seed(7)
    return {
        "layer.weight": torch.randn(8, 6, generator=g),
        "rank0.bias": torch.randn(6, generator=g).bfloat16(),
        "rank1.bias": torch.arange(5, dtype=torch.int64),
    }
