"""``control_plane.py``'s index growth: the data layer's per-trajectory cost as its index grows.

For each size N a fresh ``DataLayer`` (durable, on a real on-disk store) is given the state a
run of N trajectories leaves behind, synthesised: N ended tasks entered into the ledger (a
ledger that remembers only the most recent outcomes is given those), and the counters that go
with them. Then ``trajectories`` real ones go through it in-process (no Dask): 64 nodes lease
8 tasks each at a time, their tiny trajectories are written through the real segment writer
(not timed), completed, heartbeats renew, and batches are served and published as soon as
the buffer holds one. The process CPU spent in the data layer's calls, per trajectory, is the
marginal cost at size N (split into ingest: lease, complete, heartbeat; and batch assembly:
next_batch, served by reference: no store read, and published); a full garbage collection is
timed after it.
"""

from __future__ import annotations

import asyncio
import gc
import random
import tempfile
import time
from pathlib import Path

import psutil

from astraflow.dataflow.layer import DataLayer
from control_plane_nodes import layer_kwargs, refs_of, tiny_trajectory

NODES, CAPACITY = 64, 8


def synthesise(dl: DataLayer, n: int, group_size: int) -> None:
    """The ledger and counters of a run that ended ``n`` trajectories (module docstring)."""
    lg = dl.ledger
    if hasattr(lg, "remember_end"):  # a ledger that forgets: only what it would still hold
        for i in range(max(0, n - lg.remember), n):
            lg.remember_end(f"h{i:09d}/0", "consumed")
    else:
        from astraflow.dataflow.ledger import TaskRecord
        lg.tasks.update((f"h{i:09d}/0", TaskRecord(state="consumed")) for i in range(n))
    for key in ("created", "leased", "completed", "consumed"):
        lg.events[key] += n
    lg.state_counts["consumed"] += n
    g = dl.generated
    g.episodes += n
    g.sequences += n
    g.train_sequences += n
    dl.buffers.groups_ingested += n // group_size
    for key in ("sequences_ingested", "accepted", "consumed"):
        dl.buffers.counts["p"][key] += n


async def _one(n: int, trajectories: int, batch_size: int, group_size: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="cp-index-") as tmp:
        dl = DataLayer(**layer_kwargs(Path(tmp), batch_size, group_size, prefetch=4, durable=True))
        synthesise(dl, n, group_size)
        names = [f"w{i // 16}.n{i % 16}" for i in range(NODES)]
        writers = {name: dl.store.writer(name, batch_size=256) for name in names}
        rng = random.Random(0)
        gc.collect()
        cpu, batch_cpu, done, v = 0.0, 0.0, 0, 0
        while done < trajectories:
            t0 = time.process_time()
            got = await asyncio.gather(*(dl.lease(name, CAPACITY, 0.0, versions={"p": v}) for name in names))
            cpu += time.process_time() - t0
            refs = []
            for name, tasks in zip(names, got):
                trajs = [tiny_trajectory(t, name, v, rng) for t in tasks]
                if trajs:
                    refs.append(refs_of(trajs, writers[name].write([r for t in trajs for r in t.to_stored()])))
            t0 = time.process_time()
            await asyncio.gather(*(dl.complete(r) for r in refs))
            await asyncio.gather(*(dl.heartbeat(name, {"versions": {"p": v}}) for name in names))
            cpu += time.process_time() - t0
            t0 = time.process_time()
            while await dl.ready("p", v) >= batch_size:
                await dl.next_batch("p", v, 5.0)
                v += 1
                await dl.published("p", v)
            batch_cpu += time.process_time() - t0
            done += sum(len(t) for t in got)
        t0 = time.perf_counter()
        gc.collect()
        gc_ms = (time.perf_counter() - t0) * 1e3
        await dl.close()
        return {"index_entries": n, "trajectories": done, "dl_cpu_us_per_traj": (cpu + batch_cpu) / done * 1e6,
                "ingest_us_per_traj": cpu / done * 1e6, "batch_us_per_traj": batch_cpu / done * 1e6,
                "full_gc_ms": gc_ms, "rss_mb": psutil.Process().memory_info().rss / 2**20, "versions": v}


def index_growth(sizes: list[int], trajectories: int, batch_size: int, group_size: int) -> list[dict]:
    rows = []
    for n in sizes:
        row = asyncio.run(_one(n, trajectories, batch_size, group_size))
        print(row, flush=True)
        rows.append(row)
    return rows
