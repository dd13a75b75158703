"""The trainer's batch assembly: a batch served by reference made column-wise against row by row.

A trainer gets ``BatchRefs`` from the data layer and reads the rows from the trajectory store
(``astraflow.training.rows.BatchRows``). Both ways below read the same columns (one read per
array per batch) and make the same ``BatchItem``s; they differ in what is done per row:

* ``per-row`` (the baseline, still the path for a batch that fails the checks): each row
  becomes a ``StoredSequence``, its ``Sequence`` is checked on its own and its loss mask
  restricted to the policy's tokens;
* ``columns``: the checks run once over the batch's columns, the loss masks are restricted in
  one pass, and each row's arrays are views of the columns.

The rows are what a real data layer serves: trajectories of ``--tokens`` tokens (half prompt,
half generated), written by two nodes' segment writers on disk, leased, completed and batched by
an in-process ``DataLayer``. Both ways are timed alternately on the same batch (thread CPU time).

    python benchmarks/batch_rows.py [--batch-size 1024] [--tokens 12,512] [--reps 20]

Prints a table and ends with ``RESULT {json}`` (``speedup_<tokens>``: per-row / columns time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from astraflow.contracts import NOT_GENERATED, Provenance, Sequence, Trajectory  # noqa: E402
from astraflow.dataflow.config import DataflowConfig  # noqa: E402
from astraflow.dataflow.layer import DataLayer  # noqa: E402
from astraflow.training import rows as batch_rows  # noqa: E402
from astraflow.workloads.config import EvalConfig, WorkloadConfig  # noqa: E402
from benchmarks.run_checks import at_least, counts  # noqa: E402


def _trajectory(task, tokens: int, rng: random.Random) -> Trajectory:
    n_prompt = tokens // 2
    n_gen = tokens - n_prompt
    seq = Sequence.build(tokens=rng.sample(range(32000), tokens), loss_mask=[0] * n_prompt + [1] * n_gen,
                         logprobs=[0.0] * n_prompt + [-0.5] * n_gen,
                         policy_ids=[NOT_GENERATED] * n_prompt + [0] * n_gen,
                         versions=[NOT_GENERATED] * n_prompt + [0] * n_gen, reward=float(rng.random() < 0.5),
                         rewards={"correct": 1.0})
    return Trajectory(task.task_id, task.group_id, task.policies, task.workflow, task.kind, task.attempt, (seq,),
                      Provenance(node="n0", started_at=time.time(), finished_at=time.time()))


async def _served(tmp: Path, batch_size: int, tokens: int):
    """A batch served by reference by a data layer whose nodes wrote ``tokens``-token rows."""
    from astraflow.contracts import TrajectoryRef as Ref

    dl = DataLayer(dataflow=DataflowConfig(batch_size=batch_size),
                   workload=WorkloadConfig(name="math", params={"digits": 1}, group_size=8, eval=EvalConfig(every=0)),
                   policies=["p"], store_url=str(tmp / "store"), metrics_path=None, max_steps=10)
    writers = [dl.store.writer(f"n{i}", batch_size=4096) for i in range(2)]
    rng = random.Random(0)
    while sum(len(g.items) for g in dl.buffers.ready["p"]) < batch_size:
        tasks = await dl.lease("n0", 256)
        for k, writer in enumerate(writers):
            trajs = [_trajectory(t, tokens, rng) for t in tasks[k::2]]
            entries = writer.write([r for t in trajs for r in t.to_stored()])
            await dl.complete([Ref.of(t, [e]) for t, e in zip(trajs, entries)])
    return await dl.next_batch("p", 0, timeout=10)


def _time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        out.append(time.thread_time() - t0)
    return out


def measure(batch_size: int, tokens: int, reps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="batch-rows-") as tmp:
        served = asyncio.run(_served(Path(tmp), batch_size, tokens))
        rows = batch_rows.BatchRows(str(Path(tmp) / "store"))
        cols = rows._read(served, served.items)

        def per_row():
            return [batch_rows._item(served.policy, it, row) for it, row in zip(served.items, cols.rows())]

        def columns():
            assert batch_rows._well_formed(cols)
            return batch_rows._items(served.policy, served.items, cols)

        for a, b in zip(per_row(), columns()):  # the same items either way
            assert a.sequence == b.sequence and np.array_equal(a.loss_mask, b.loss_mask) and a.task_id == b.task_id
        read = _time(lambda: rows._read(served, served.items), reps)
        slow, fast = [], []
        for _ in range(reps):  # alternately, so that load drifts hit both alike
            slow += _time(per_row, 1)
            fast += _time(columns, 1)
    per_seq = 1e6 / batch_size
    return {"tokens": tokens, "batch": batch_size, "read_us_per_seq": statistics.median(read) * per_seq,
            "per_row_us_per_seq": statistics.median(slow) * per_seq,
            "columns_us_per_seq": statistics.median(fast) * per_seq,
            "speedup": statistics.median(slow) / statistics.median(fast)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=at_least(1), default=1024)
    ap.add_argument("--tokens", type=counts(), default="12,512", help="tokens per row, comma-separated")
    ap.add_argument("--reps", type=at_least(1), default=20)
    args = ap.parse_args(argv)
    rows = [measure(args.batch_size, t, args.reps) for t in args.tokens]
    cols = ["tokens", "batch", "read_us_per_seq", "per_row_us_per_seq", "columns_us_per_seq", "speedup"]
    print("batch assembly on the trainer's side (CPU µs per sequence, medians; read: the store read both share)")
    print("  ".join(f"{c:>20}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>20.2f}" if isinstance(r[c], float) else f"{r[c]:>20}" for c in cols))
    result = {f"speedup_{r['tokens']}": round(r["speedup"], 2) for r in rows}
    result.update({f"columns_us_per_seq_{r['tokens']}": round(r["columns_us_per_seq"], 2) for r in rows})
    result.update({f"per_row_us_per_seq_{r['tokens']}": round(r["per_row_us_per_seq"], 2) for r in rows})
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
