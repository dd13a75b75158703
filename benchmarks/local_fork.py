"""What forking local workers from one process (``cluster.local_fork``) saves a small run.

Side by side in one run, alternating, on the same config (the tiny example, a few steps):

* **fresh** (baseline, ``cluster.local_fork=false``): every local Dask worker is a new
  interpreter that imports Dask, torch, transformers and AstraFlow's components itself;
* **forked** (the default): the fork server imports them once, while the run starts, and
  each worker is forked from it.

Each run is ``astraflow run`` in a subprocess; the CPU seconds of every process it started are
sampled until it ends (a process's CPU is read while it lives, every 0.1 s: what a process
spends in its last moments is missed alike on both sides).

    python benchmarks/local_fork.py [--rounds 3] [--steps 3]

Ends with ``RESULT {json}``: medians of both and ``wall_ratio``, ``cpu_ratio`` (forked over
fresh; below 1 is less).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "tiny" / "config.yaml"


def one_run(run_dir: Path, steps: int, fork: bool) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the run's whole process tree) of one tiny run."""
    cmd = [sys.executable, "-m", "astraflow", "run", str(CONFIG), "--run-dir", str(run_dir), "--quiet",
           "--set", f"run.max_steps={steps}", "--set", f"cluster.local_fork={str(fork).lower()}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root, cpu = psutil.Process(proc.pid), {}
    while proc.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            try:
                t = p.cpu_times()
                cpu[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the run failed ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
    fresh = [log.name for log in (run_dir / "jobs").glob("*.log") if "not forked" in log.read_text(errors="replace")]
    if fork and fresh:  # a comparison of fresh with fresh would say nothing
        raise RuntimeError(f"workers of the forked run started fresh (their logs say why): {fresh}")
    return wall, sum(cpu.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="pairs of runs, alternating which goes first")
    ap.add_argument("--steps", type=int, default=3, help="run.max_steps of each run")
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be at least 1")
    tmp = Path(tempfile.mkdtemp(prefix="local-fork-bench-"))
    rows: dict[str, list[tuple[float, float]]] = {"fresh": [], "forked": []}
    try:
        for r in range(args.rounds):
            order = ("fresh", "forked") if r % 2 == 0 else ("forked", "fresh")
            for mode in order:
                rows[mode].append(one_run(tmp / f"{mode}-{r}", args.steps, fork=mode == "forked"))
                print(f"round {r + 1}/{args.rounds} {mode}: {rows[mode][-1][0]:.1f} s wall, "
                      f"{rows[mode][-1][1]:.1f} s CPU", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {m: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for m, v in rows.items()}
    table = Table(title=f"tiny example, {args.steps} steps, {args.rounds} runs each (median)")
    for col in ("local workers", "wall s", "CPU s", "runs (wall / CPU)"):
        table.add_column(col)
    for mode, (wall, cpu) in med.items():
        table.add_row(mode, f"{wall:.1f}", f"{cpu:.1f}", ", ".join(f"{w:.1f}/{c:.1f}" for w, c in rows[mode]))
    Console().print(table)
    out = {"rounds": args.rounds, "steps": args.steps,
           "fresh_wall_s": round(med["fresh"][0], 2), "forked_wall_s": round(med["forked"][0], 2),
           "fresh_cpu_s": round(med["fresh"][1], 2), "forked_cpu_s": round(med["forked"][1], 2),
           "wall_ratio": round(med["forked"][0] / med["fresh"][0], 3),
           "cpu_ratio": round(med["forked"][1] / med["fresh"][1], 3)}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
