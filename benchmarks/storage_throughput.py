"""Trajectory-store throughput against a raw copy of the same bytes on the same disk.

Why it exists: the Zarr store adds chunking, commit markers and fsyncs on top of plain file
writes; this measures what that costs. ``--writers`` processes (one segment each, like RaaS
nodes) write ``--n`` trajectories of ~512 tokens in batches of 64; then one reader counts the
committed entries and reads every entry back (like the data layer). The baseline, in the same run, writes
the same bytes (per-token arrays, per-entry numbers, string columns) as plain files with one
process, fsyncs them and reads them back.

    python benchmarks/storage_throughput.py [--n 10000] [--writers 4] [--out DIR] [--no-durable]

Ends with ``RESULT {json}``; ``ratio_vs_raw`` = store throughput / raw throughput over
write + read (goal >= 0.5).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from storage.trajectories import EntryRef, StoredSequence, open_trajectory_store  # noqa: E402


def make_rows(writer: int, n: int, tokens: int) -> list[StoredSequence]:
    rng = np.random.default_rng(writer)
    rows = []
    for i in range(n):
        length = int(rng.integers(tokens * 3 // 4, tokens * 5 // 4 + 1))
        prompt = length // 4
        versions = np.full(length, -1, np.int32)
        versions[prompt:] = 7
        rows.append(StoredSequence(
            task_id=f"w{writer}/t{i}", group_id=f"w{writer}/g{i // 8}", seq_index=0, num_sequences=1,
            tokens=rng.integers(0, 150_000, length).astype(np.int32),
            loss_mask=(versions >= 0).astype(np.uint8),
            logprobs=np.where(versions >= 0, -rng.random(length), 0).astype(np.float32),
            policy_ids=np.where(versions >= 0, 0, -1).astype(np.int16),
            versions=versions, reward=float(rng.random()), finish_reason="stop",
            meta=json.dumps({"policies": ["actor"], "workflow": "math_single", "attempt": 0,
                             "provenance": {"node": f"raas-{writer}", "partition": "cpu"}}),
        ))
    return rows


def payload(rows: list[StoredSequence]) -> list[bytes]:
    """The bytes a store must keep for ``rows``, as plain buffers (the raw baseline writes them)."""
    out = [np.concatenate([getattr(r, k) for r in rows]).tobytes()
           for k in ("tokens", "loss_mask", "logprobs", "policy_ids", "versions")]
    out.append(np.array([[len(r.tokens), r.seq_index, r.num_sequences, 7, 7, 0] for r in rows], np.int64).tobytes())
    out.append(np.array([r.reward for r in rows], np.float64).tobytes())
    out.append(json.dumps([[r.task_id, r.group_id, r.finish_reason, r.meta] for r in rows]).encode())
    return out


def writer_main(url: str, writer: int, n: int, tokens: int, batch: int, durable: bool, barrier, results) -> None:
    rows = make_rows(writer, n, tokens)
    warm_up()
    store = open_trajectory_store(url, durable=durable)
    w = store.writer(f"raas-{writer}", batch_size=batch)
    barrier.wait(timeout=120)
    t0 = time.time()
    for i in range(0, n, batch):
        w.write(rows[i:i + batch])
    w.close()
    results.put((writer, t0, time.time()))


def warm_up() -> None:
    """Zarr initialises codecs and its event loop on first use; a long-lived reader pays that once."""
    store = open_trajectory_store(f"memory://warm-up-{os.getpid()}")
    store.read(store.writer("w").write(make_rows(99, 2, 16)))


def bench_store(root: Path, n: int, writers: int, tokens: int, batch: int, durable: bool) -> dict:
    url = str(root / "store")
    open_trajectory_store(url)  # create once, before the writers race to
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(writers + 1), ctx.Queue()
    per = [n // writers + (1 if w < n % writers else 0) for w in range(writers)]
    procs = [ctx.Process(target=writer_main, args=(url, w, per[w], tokens, batch, durable, barrier, results))
             for w in range(writers)]
    for p in procs:
        p.start()
    barrier.wait(timeout=300)
    times = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"writer exited with {p.exitcode}"
    write_s = max(t[2] for t in times) - min(t[1] for t in times)

    warm_up()
    t0 = time.perf_counter()
    reader = open_trajectory_store(url, "r")
    refs = [EntryRef(s, i) for s in reader.segments() for i in range(reader.count(s))]
    got_tokens = 0
    for i in range(0, len(refs), 1024):
        for row in reader.read(refs[i:i + 1024]):
            got_tokens += len(row.tokens)
    read_s = time.perf_counter() - t0
    assert len(refs) == n, f"read back {len(refs)} of {n} entries"
    return {"write_s": write_s, "read_s": read_s, "tokens": got_tokens}


def bench_raw(root: Path, n: int, writers: int, tokens: int) -> dict:
    per = [n // writers + (1 if w < n % writers else 0) for w in range(writers)]
    blobs = [payload(make_rows(w, per[w], tokens)) for w in range(writers)]
    nbytes = sum(len(b) for bl in blobs for b in bl)
    d = root / "raw"
    d.mkdir()
    t0 = time.perf_counter()
    for w, bl in enumerate(blobs):
        for k, b in enumerate(bl):
            with open(d / f"{w}-{k}.bin", "wb") as f:
                f.write(b)
                f.flush()
                os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = 0
    for w, bl in enumerate(blobs):
        for k in range(len(bl)):
            back += len((d / f"{w}-{k}.bin").read_bytes())
    read_s = time.perf_counter() - t0
    assert back == nbytes
    return {"write_s": write_s, "read_s": read_s, "bytes": nbytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=10_000, help="trajectories in total")
    ap.add_argument("--writers", type=int, default=4, help="writer processes (one segment each)")
    ap.add_argument("--tokens", type=int, default=512, help="mean tokens per trajectory")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None, help="scratch dir (default: benchmarks/out/<tmp>)")
    ap.add_argument("--no-durable", action="store_true", help="skip fsync of chunk data (scratch stores)")
    args = ap.parse_args()
    base = args.out or Path(__file__).resolve().parent / "out"
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="storage_throughput-", dir=base))
    try:
        raw = bench_raw(root, args.n, args.writers, args.tokens)
        store = bench_store(root, args.n, args.writers, args.tokens, args.batch_size, not args.no_durable)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mb = raw["bytes"] / 1e6
    store_total = store["write_s"] + store["read_s"]
    raw_total = raw["write_s"] + raw["read_s"]
    result = {
        "n": args.n, "writers": args.writers, "mean_tokens": args.tokens, "durable": not args.no_durable,
        "payload_mb": round(mb, 1),
        "store_write_traj_s": round(args.n / store["write_s"]), "store_read_traj_s": round(args.n / store["read_s"]),
        "store_write_mb_s": round(mb / store["write_s"], 1), "store_read_mb_s": round(mb / store["read_s"], 1),
        "raw_write_mb_s": round(mb / raw["write_s"], 1), "raw_read_mb_s": round(mb / raw["read_s"], 1),
        "store_s": round(store_total, 3), "raw_s": round(raw_total, 3),
        "ratio_vs_raw": round(raw_total / store_total, 3),
    }
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"trajectory store vs raw files: {args.n} trajectories x ~{args.tokens} tokens, "
                    f"{args.writers} writers, {mb:.0f} MB")
    for c in ("", "write s", "write traj/s", "write MB/s", "read s", "read traj/s", "read MB/s"):
        t.add_column(c, justify="right")
    for name, r in (("zarr store", store), ("raw files + fsync", raw)):
        t.add_row(name, f"{r['write_s']:.3f}", f"{args.n / r['write_s']:,.0f}", f"{mb / r['write_s']:,.0f}",
                  f"{r['read_s']:.3f}", f"{args.n / r['read_s']:,.0f}", f"{mb / r['read_s']:,.0f}")
    Console().print(t)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
