"""Trajectory-store throughput against raw copies of the same bytes on the same disk.

Why it exists: the Zarr store adds chunking, commit markers and fsyncs on top of plain file
writes; this measures what that costs. ``--writers`` processes (one segment each, like RaaS
nodes) write ``--n`` trajectories of ~512 tokens in batches of 64 as a RaaS node writes them:
each batch staged with ``submit`` while up to ``--write-ahead`` earlier ones are being
committed (grouped into one flush round), each durable before its future resolves; the same
with every ``write`` waiting for its own commit is the extra row ``each write waits``
(``ratio_vs_raw_sync``). Then one reader counts the committed entries and reads every entry back in
batches of 1024 with ``read_columns`` (concatenated columns + offsets: the path a trainer
builds its token tensors from; a checkout without it reads rows). The same entries read as
rows (``read``: one object per entry, as the data layer and monitors read) are timed as an
extra figure, ``store_read_rows_mb_s``, outside the ratios. Two baselines write the same bytes (per-token arrays, per-entry
numbers, string columns) as plain files and read them back as bytes:

* ``raw`` (the goal's baseline, disk bandwidth): one process writes each writer's bytes as
  one file per column and fsyncs each file once, at the end;
* ``raw_commits`` (the store's durability for free): ``--writers`` processes each append every
  batch's bytes to one file and fdatasync it before the next batch, as a minimal durable log.

``--reps`` runs raw, raw_commits and the store in turn that many times and reports medians
(the machine's disk and CPUs are shared: single readings vary severalfold).

    python benchmarks/storage_throughput.py [--n 10000] [--writers 4] [--reps 3] [--no-durable]
        [--write-ahead 4]

Ends with ``RESULT {json}``; ``ratio_vs_raw`` = raw time / store time over write + read (goal
>= 0.5); ``ratio_vs_raw_commits`` the same against the per-batch durable log;
``ratio_vs_raw_sync`` the store whose every write waits for its commit.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run_checks import at_least  # noqa: E402
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


def store_writer_main(writer: int, n: int, url: str, tokens: int, batch: int, durable: bool, ahead: int,
                      barrier, results) -> None:
    """One writer: ``ahead`` 0 waits for each write's commit; otherwise each batch is staged
    while up to ``ahead`` earlier ones commit (a checkout without ``submit`` always waits)."""
    rows = make_rows(writer, n, tokens)
    warm_up()
    store = open_trajectory_store(url, durable=durable)
    w = store.writer(f"raas-{writer}", batch_size=batch)
    submit = getattr(w, "submit", None) if ahead else None
    barrier.wait(timeout=120)
    t0 = time.time()
    pending = []
    for i in range(0, n, batch):
        if submit is None:
            w.write(rows[i:i + batch])
            continue
        pending.append(submit(rows[i:i + batch]))
        if len(pending) > ahead:
            pending.pop(0).result()
    for f in pending:
        f.result()
    w.close()
    results.put((writer, t0, time.time()))


def warm_up() -> None:
    """Zarr initialises codecs and its event loop on first use; a long-lived reader pays that once."""
    store = open_trajectory_store(f"memory://warm-up-{os.getpid()}")
    store.read(store.writer("w").write(make_rows(99, 2, 16)))


def run_writers(target, writers: int, per: list[int], extra: tuple) -> float:
    """Start ``writers`` processes running ``target(w, per[w], *extra, barrier, results)``;
    the seconds from the first one's start to the last one's end."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(writers + 1), ctx.Queue()
    procs = [ctx.Process(target=target, args=(w, per[w], *extra, barrier, results)) for w in range(writers)]
    for p in procs:
        p.start()
    barrier.wait(timeout=300)
    times = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"writer exited with {p.exitcode}"
    return max(t[2] for t in times) - min(t[1] for t in times)


def split(n: int, writers: int) -> list[int]:
    return [n // writers + (1 if w < n % writers else 0) for w in range(writers)]


def bench_store(root: Path, n: int, writers: int, tokens: int, batch: int, durable: bool, ahead: int) -> dict:
    url = str(root / f"store-{ahead}")
    open_trajectory_store(url)  # create once, before the writers race to
    write_s = run_writers(store_writer_main, writers, split(n, writers), (url, tokens, batch, durable, ahead))
    warm_up()
    t0 = time.perf_counter()
    reader = open_trajectory_store(url, "r")
    refs = [EntryRef(s, i) for s in reader.segments() for i in range(reader.count(s))]
    # the path trainers use: columns (a checkout without read_columns reads rows here)
    read_columns = getattr(reader, "read_columns", None)
    got_tokens = 0
    for i in range(0, len(refs), 1024):
        if read_columns is not None:
            got_tokens += len(read_columns(refs[i:i + 1024]).tokens)
        else:
            got_tokens += sum(len(row.tokens) for row in reader.read(refs[i:i + 1024]))
    read_s = time.perf_counter() - t0
    assert len(refs) == n, f"read back {len(refs)} of {n} entries"
    # extra figure, not in the ratios: the same entries read as one object per row
    t0 = time.perf_counter()
    rows_reader = open_trajectory_store(url, "r")
    row_tokens = sum(len(row.tokens) for i in range(0, len(refs), 1024) for row in rows_reader.read(refs[i:i + 1024]))
    read_rows_s = time.perf_counter() - t0
    assert row_tokens == got_tokens
    return {"write_s": write_s, "read_s": read_s, "read_rows_s": read_rows_s, "tokens": got_tokens,
            "columns": read_columns is not None}


def raw_log_main(writer: int, n: int, d: str, tokens: int, batch: int, durable: bool, barrier, results) -> None:
    rows = make_rows(writer, n, tokens)
    batches = [b"".join(payload(rows[i:i + batch])) for i in range(0, n, batch)]
    barrier.wait(timeout=120)
    t0 = time.time()
    with open(Path(d) / f"log-{writer}.bin", "wb") as f:
        for b in batches:
            f.write(b)
            f.flush()
            if durable:
                os.fdatasync(f.fileno())
    results.put((writer, t0, time.time()))


def bench_raw_commits(root: Path, n: int, writers: int, tokens: int, batch: int, durable: bool) -> dict:
    d = root / "raw_commits"
    d.mkdir()
    write_s = run_writers(raw_log_main, writers, split(n, writers), (str(d), tokens, batch, durable))
    t0 = time.perf_counter()
    back = sum(len((d / f"log-{w}.bin").read_bytes()) for w in range(writers))
    read_s = time.perf_counter() - t0
    return {"write_s": write_s, "read_s": read_s, "bytes": back}


def bench_raw(root: Path, n: int, writers: int, tokens: int) -> dict:
    per = split(n, writers)
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
    ap.add_argument("--n", type=at_least(1), default=10_000, help="trajectories in total")
    ap.add_argument("--writers", type=at_least(1), default=4, help="writer processes (one segment each)")
    ap.add_argument("--tokens", type=at_least(1), default=512, help="mean tokens per trajectory")
    ap.add_argument("--batch-size", type=at_least(1), default=64)
    ap.add_argument("--write-ahead", type=at_least(1), default=4,
                    help="batches a writer stages while earlier ones commit (a RaaS node's default)")
    ap.add_argument("--reps", type=at_least(1), default=1, help="alternating repetitions (medians are reported)")
    ap.add_argument("--out", type=Path, default=None, help="scratch dir (default: benchmarks/out/<tmp>)")
    ap.add_argument("--no-durable", action="store_true", help="skip fsync of chunk data (scratch stores)")
    args = ap.parse_args()
    base = args.out or Path(__file__).resolve().parent / "out"
    base.mkdir(parents=True, exist_ok=True)
    durable = not args.no_durable
    runs: dict[str, list[dict]] = {"zarr store": [], "zarr store, each write waits": [], "raw files + fsync": [],
                                   "raw log, fsync per batch": []}
    for _ in range(args.reps):
        root = Path(tempfile.mkdtemp(prefix="storage_throughput-", dir=base))
        try:
            runs["raw files + fsync"].append(bench_raw(root, args.n, args.writers, args.tokens))
            runs["raw log, fsync per batch"].append(
                bench_raw_commits(root, args.n, args.writers, args.tokens, args.batch_size, durable))
            runs["zarr store"].append(
                bench_store(root, args.n, args.writers, args.tokens, args.batch_size, durable, args.write_ahead))
            runs["zarr store, each write waits"].append(
                bench_store(root, args.n, args.writers, args.tokens, args.batch_size, durable, 0))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("write_s", "read_s")} for name, rs in runs.items()}
    for name, rs in runs.items():  # the ratios are of medians of totals, like the times shown
        med[name]["total_s"] = statistics.median(r["write_s"] + r["read_s"] for r in rs)
    store, raw, log = med["zarr store"], med["raw files + fsync"], med["raw log, fsync per batch"]
    sync = med["zarr store, each write waits"]
    mb = runs["raw files + fsync"][0]["bytes"] / 1e6
    result = {
        "n": args.n, "writers": args.writers, "write_ahead": args.write_ahead, "mean_tokens": args.tokens, "durable": durable, "reps": args.reps,
        "payload_mb": round(mb, 1),
        "store_write_traj_s": round(args.n / store["write_s"]), "store_read_traj_s": round(args.n / store["read_s"]),
        "store_write_mb_s": round(mb / store["write_s"], 1), "store_read_mb_s": round(mb / store["read_s"], 1),
        "raw_write_mb_s": round(mb / raw["write_s"], 1), "raw_read_mb_s": round(mb / raw["read_s"], 1),
        "raw_commits_write_mb_s": round(mb / log["write_s"], 1),
        "store_read_rows_mb_s": round(mb / statistics.median(r["read_rows_s"] for r in runs["zarr store"]), 1),
        "store_read_columns": runs["zarr store"][0]["columns"],
        "store_s": round(store["total_s"], 3), "raw_s": round(raw["total_s"], 3),
        "raw_commits_s": round(log["total_s"], 3),
        "ratio_vs_raw": round(raw["total_s"] / store["total_s"], 3),
        "ratio_vs_raw_commits": round(log["total_s"] / store["total_s"], 3),
        "store_sync_s": round(sync["total_s"], 3),
        "ratio_vs_raw_sync": round(raw["total_s"] / sync["total_s"], 3),
        "ratio_vs_raw_each": [round((a["write_s"] + a["read_s"]) / (b["write_s"] + b["read_s"]), 3)
                              for a, b in zip(runs["raw files + fsync"], runs["zarr store"])],
    }
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"trajectory store vs raw files: {args.n} trajectories x ~{args.tokens} tokens, "
                    f"{args.writers} writers, {mb:.0f} MB, median of {args.reps}")
    for c in ("", "write s", "write traj/s", "write MB/s", "read s", "read traj/s", "read MB/s"):
        t.add_column(c, justify="right")
    for name, r in med.items():
        t.add_row(name, f"{r['write_s']:.3f}", f"{args.n / r['write_s']:,.0f}", f"{mb / r['write_s']:,.0f}",
                  f"{r['read_s']:.3f}", f"{args.n / r['read_s']:,.0f}", f"{mb / r['read_s']:,.0f}")
    Console().print(t)
    print(f"store read as rows (extra, not in the ratios): {result['store_read_rows_mb_s']} MB/s; "
          f"read half used {'read_columns' if result['store_read_columns'] else 'read (rows)'}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
