"""What Dask's own monitors cost an AstraFlow process that has nothing to do, side by side.

A Dask scheduler and two workers, started with the command line AstraFlow uses
(``schedulers.command.worker_command``), sit idle for ``--seconds``; the CPU time each process
used in that window is read from ``/proc``. Once with Dask's defaults (profiler every 10 ms,
event-loop tick every 20 ms, memory monitor every 0.1 s, system monitor every 0.5 s), once with
``schedulers.command.QUIET_DASK_ENV`` (what every process ``astraflow run`` starts gets). On a
2-core machine a run has a scheduler and 3-4 workers, so their idle cost is CPU the trainer and
the engines do not get.

    python benchmarks/dask_overhead.py [--seconds 20]

Prints a table and ends with ``RESULT {json}`` (``worker_cpu_ratio``: quiet / default).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks.run_checks import above, at_least  # noqa: E402
from schedulers.command import QUIET_DASK_ENV, worker_command  # noqa: E402

#: Dask's own defaults for the same keys (set explicitly, so that the shell cannot change them)
DASK_DEFAULTS = {
    "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "True",
    "DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "20ms",
    "DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL": "500ms",
    "DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL": "100ms",
}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(settings: dict[str, str], seconds: float, settle: float) -> dict[str, float]:
    """CPU share (cores) of an idle scheduler and two idle workers over ``seconds``."""
    env = {**os.environ, **settings, "PYTHONPATH": str(ROOT)}
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    procs = {"scheduler": subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port),
         "--dashboard-address", "127.0.0.1:0"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)}
    try:
        time.sleep(2.0)
        for i in range(2):
            procs[f"worker {i}"] = subprocess.Popen(
                worker_command(address, f"idle-w{i}", {}, host="127.0.0.1"),
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(settle)  # imports done, registered with the scheduler
        dead = [name for name, p in procs.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited before the measurement")
        before = {name: _cpu_seconds(p.pid) for name, p in procs.items()}
        t0 = time.monotonic()
        time.sleep(seconds)
        dt = time.monotonic() - t0
        return {name: (_cpu_seconds(p.pid) - before[name]) / dt for name, p in procs.items()}
    finally:
        for p in reversed(list(procs.values())):  # workers first, then the scheduler
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=above(0), default=20.0, help="measurement window per setting")
    ap.add_argument("--settle", type=at_least(0, float), default=8.0, help="seconds after start before measuring")
    args = ap.parse_args()
    console = Console()
    results = {}
    for label, settings in (("dask defaults", DASK_DEFAULTS), ("astraflow (quiet)", QUIET_DASK_ENV)):
        console.print(f"measuring {label} for {args.seconds:.0f} s ...")
        results[label] = measure(settings, args.seconds, args.settle)
    table = Table(title=f"idle CPU (% of one core) over {args.seconds:.0f} s")
    table.add_column("process")
    for label in results:
        table.add_column(label, justify="right")
    for name in results["dask defaults"]:
        table.add_row(name, *(f"{100 * r[name]:.2f}" for r in results.values()))
    console.print(table)
    d, q = results["dask defaults"], results["astraflow (quiet)"]
    worker = lambda r: (r["worker 0"] + r["worker 1"]) / 2  # noqa: E731
    res = {
        "worker_cpu_default": round(worker(d), 4), "worker_cpu_quiet": round(worker(q), 4),
        "scheduler_cpu_default": round(d["scheduler"], 4), "scheduler_cpu_quiet": round(q["scheduler"], 4),
        "worker_cpu_ratio": round(worker(q) / max(worker(d), 1e-9), 3),
        "scheduler_cpu_ratio": round(q["scheduler"] / max(d["scheduler"], 1e-9), 3),
        "seconds": args.seconds,
    }
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
