"""How long a pool of workers takes to join a Dask scheduler, and to leave it, per backend.

Baseline: `LocalScheduler` (subprocesses). Compared: `SlurmScheduler` on whatever Slurm answers
(tests/slurm/local_slurm.sh on one host); skipped, and said so, when none does. Same worker
command, same scheduler, same pool size, so the difference is the job scheduler's own latency.

    python benchmarks/worker_startup.py [--workers 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distributed import Client  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from schedulers import Partition, make_scheduler  # noqa: E402
from schedulers.slurm import SlurmScheduler  # noqa: E402
from tests.schedulers.dask_fixtures import start_dask_scheduler, stop, wait_for_workers  # noqa: E402


def measure(sched, part: Partition, client: Client, address: str, n: int, start: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    refs = sched.submit(part, address, count=n, start_index=start)
    names = {r.worker_name for r in refs}
    if not names <= wait_for_workers(client, names, present=True, deadline_s=120):
        raise RuntimeError(f"workers did not join: {names}")
    joined = time.perf_counter() - t0
    t1 = time.perf_counter()
    sched.cancel([r.job_id for r in refs])
    if wait_for_workers(client, names, present=False, deadline_s=60) & names:
        raise RuntimeError(f"workers did not leave: {names}")
    return joined, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=3, help="workers per pool, submitted together")
    ap.add_argument("--rounds", type=int, default=2, help="pools started and stopped per backend (median reported)")
    args = ap.parse_args()
    if args.workers < 1 or args.rounds < 1:
        ap.error("--workers and --rounds must be at least 1")
    tmp = Path(tempfile.mkdtemp(prefix="af-bench-"))
    results: dict[str, dict[str, float]] = {}
    try:  # the scratch directory (scheduler files, worker logs) goes on a failure or Ctrl-C too
        proc, address, _ = start_dask_scheduler(tmp)
        client = Client(address, timeout=20)
        backends = {"local": (make_scheduler("local", log_dir=tmp / "logs"), Partition(name="bench"))}
        slurm = SlurmScheduler(tmp / "jobs", interface="lo", tag="bench")
        if slurm.ping():
            backends["slurm"] = (slurm, Partition(name="bench", scheduler="slurm", slurm_partition="h100",
                                                  walltime="10"))
        else:
            print("Slurm comparison skipped: no Slurm answers here (scontrol ping); start the local one with "
                  "`bash tests/slurm/local_slurm.sh start` (root) and run this again", flush=True)
        try:
            for kind, (sched, part) in backends.items():
                runs = [measure(sched, part, client, address, args.workers, r * args.workers)
                        for r in range(args.rounds)]
                results[kind] = {"join_s": statistics.median(j for j, _ in runs),
                                 "leave_s": statistics.median(l for _, l in runs)}
        finally:
            client.close()
            stop(proc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table = Table(title=f"{args.workers} workers join / leave one Dask scheduler (median of {args.rounds})")
    for col in ("backend", "submit→all joined (s)", "cancel→all gone (s)", "join vs local"):
        table.add_column(col)
    for kind, r in results.items():
        table.add_row(kind, f"{r['join_s']:.2f}", f"{r['leave_s']:.2f}", f"{r['join_s'] / results['local']['join_s']:.2f}×")
    Console().print(table)
    out = {"workers": args.workers, **{f"{k}_{m}": round(v, 3) for k, r in results.items() for m, v in r.items()},
           "slurm_measured": "slurm" in results}
    if "slurm" in results:
        out["slurm_over_local_join"] = round(results["slurm"]["join_s"] / results["local"]["join_s"], 3)
        out["slurm_over_local_leave"] = round(results["slurm"]["leave_s"] / results["local"]["leave_s"], 3)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
