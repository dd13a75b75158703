"""Elastic partitions on a real Slurm: how fast a running run grows and shrinks.

One run of `examples/elastic/config.yaml` (tiny model; data layer and trainer local, RaaS nodes as
Slurm jobs in partition h100), driven through the real CLI while it trains:

1. throughput with the first partition alone;
2. `partitions add a100` (Slurm) -> seconds until the first trajectory from a100 is committed and
   visible in `astraflow status` (job start, worker join, actor placement, model load and weight
   catch-up included; goal <= 30 s), and the same for a `scheduler: local` partition added next
   (the baseline: no Slurm in the path);
3. throughput with both;
4. `partitions remove h100 --drain` -> seconds until its job is cancelled, then throughput after;
5. Ctrl-C (a clean stop), then the ledger: lost tasks = tasks never ended + tasks failed, and
   the rollouts wasted: generated per sequence trained and the fraction dropped as stale
   (``--admission prefetch`` runs the former admission rule for comparison; with ``version``
   more nodes than the trainer can use are left idle rather than rolling out stale work).

Brings up the local Slurm (tests/slurm/local_slurm.sh) when none answers, and stops it after if
it did, unless ``squeue`` then lists a job that is not this run's (someone else is using it: it is
left running, and said so). Its scratch directory (``/tmp/af-elastic-*``) is removed at exit.

    python benchmarks/elastic.py [--window 8] [--admission version|prefetch]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks.run_checks import above  # noqa: E402
from schedulers.slurm import SlurmScheduler, run_tag  # noqa: E402
from schedulers.slurm_cli import SlurmCommandError, run_slurm  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def cli(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run([sys.executable, "-m", "astraflow", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"astraflow {' '.join(args)} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
    return proc.stdout


def status(run_dir: Path) -> dict:
    f = run_dir / "control" / "status.json"
    return json.loads(f.read_text()) if f.exists() else {}


def wait(what: str, check, deadline_s: float, interval: float = 0.2):
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what}: not within {deadline_s:.0f}s")


def completed(snapshot: dict) -> int:
    """Trajectories committed so far, all partitions (the data layer's node table in a status)."""
    return sum(int(n.get("completed", 0)) for n in snapshot.get("data_layer", {}).get("nodes", {}).values())


def rate(run_dir: Path, seconds: float) -> float:
    """Trajectories per second over at least ``seconds``, between two status snapshots and by
    their own ``written_at``: the orchestrator rewrites the status once a tick, so a window timed
    by this process's clock alone counts a stale snapshot's trajectories (0 in a short window)."""
    first = wait("a status snapshot", lambda: (s := status(run_dir)).get("written_at") and s, 60)
    time.sleep(seconds)
    last = wait(f"a status snapshot {seconds:.0f}s newer",
                lambda: (s := status(run_dir)).get("written_at", 0) >= first["written_at"] + seconds and s, 120)
    return (completed(last) - completed(first)) / (last["written_at"] - first["written_at"])


def ratio(num: float, den: float) -> float | None:
    """``num / den``; None (not a huge number) when nothing was measured in the denominator's window."""
    return num / den if den > 0 else None


def add_and_time(run_dir: Path, name: str, *opts: str) -> float:
    t0 = time.time()
    cli("partitions", "add", str(run_dir), name, "--wait", "0", *opts)
    wait(f"first trajectory from {name}",
         lambda: status(run_dir).get("partitions", {}).get(name, {}).get("completed", 0) > 0, 120)
    return time.time() - t0


def others_in_squeue(tag: str) -> list[str] | None:
    """Ids of the jobs ``squeue`` lists (any state) that are not this run's (``--comment`` ``tag``);
    None when squeue did not answer."""
    try:
        data = json.loads(run_slurm(["squeue", "--json", "--states=all"], timeout=30))
    except (SlurmCommandError, ValueError):
        return None
    return [str(j.get("job_id")) for j in data.get("jobs", []) if j.get("comment") != tag]


def stop_local_slurm(tag: str) -> None:
    """Stop the local Slurm this benchmark started, only when no one else has submitted to it
    meanwhile: stopping it would kill their jobs."""
    others = others_in_squeue(tag)
    if others is None:
        print("left the local Slurm running: squeue did not answer, so whether others use it is unknown; "
              "stop it with: bash tests/slurm/local_slurm.sh stop", file=sys.stderr)
    elif others:
        print(f"left the local Slurm running: squeue lists {len(others)} job(s) not this run's "
              f"({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}); stop it when they are done with: "
              "bash tests/slurm/local_slurm.sh stop", file=sys.stderr)
    else:
        subprocess.run(["bash", str(ROOT / "tests" / "slurm" / "local_slurm.sh"), "stop"], check=True, timeout=60)


def log_tail(log: Path, lines: int = 20) -> None:
    """The end of the run's log on stderr (the scratch directory that holds it is removed at exit)."""
    try:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return
    print(f"the last lines of the run's log ({log}, removed at exit):", *tail, sep="\n", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=above(0), default=8.0, help="seconds per throughput measurement")
    ap.add_argument("--admission", choices=["version", "prefetch"], default="version",
                    help="dataflow.admission of the run")
    args = ap.parse_args()
    console = Console()
    started_slurm = False
    if not SlurmScheduler(tempfile.gettempdir()).ping():
        subprocess.run(["bash", str(ROOT / "tests" / "slurm" / "local_slurm.sh"), "start"], check=True, timeout=300)
        started_slurm = True
    tmp = Path(tempfile.mkdtemp(prefix="af-elastic-"))
    atexit.register(shutil.rmtree, tmp, True)  # at exit, also after a failure or Ctrl-C
    run_dir, model = tmp / "run", tmp / "model"
    subprocess.run([sys.executable, "-m", "astraflow", "model", "init", str(model), "--preset", "tiny"],
                   check=True, env=ENV, cwd=ROOT, capture_output=True, timeout=300)
    log = open(tmp / "run.log", "w")
    run = subprocess.Popen(
        [sys.executable, "-m", "astraflow", "run", "examples/elastic/config.yaml", "--run-dir", str(run_dir),
         "--set", f"policies.0.model={model}", "--set", "run.max_steps=100000", "--set", "workload.eval.every=0",
         "--set", "run.timeout_s=900", "--set", f"dataflow.admission={args.admission}"],
        cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT,
    )
    tag = None
    res: dict = {}
    try:
        wait("h100 serving", lambda: status(run_dir).get("partitions", {}).get("h100", {}).get("serving", 0) > 0, 240)
        tag = status(run_dir)["tag"]
        res["traj_per_s_h100_only"] = rate(run_dir, args.window)
        res["seconds_to_first_trajectory"] = add_and_time(run_dir, "a100", "--slurm-partition", "a100", "--hardware", "A100")
        res["traj_per_s_h100_a100"] = rate(run_dir, args.window)
        res["seconds_to_first_trajectory_local"] = add_and_time(run_dir, "loc", "--scheduler", "local")
        cli("partitions", "remove", str(run_dir), "loc", "--now", "--wait", "60")
        t0 = time.time()
        cli("partitions", "remove", str(run_dir), "h100", "--drain", "--wait", "120")
        res["seconds_to_drain"] = time.time() - t0
        res["drain_seconds_orchestrator"] = status(run_dir)["partitions"]["h100"]["drain_seconds"]
        res["traj_per_s_a100_only"] = rate(run_dir, args.window)
    except BaseException:
        log.flush()
        log_tail(tmp / "run.log")
        raise
    finally:
        run.send_signal(signal.SIGINT)
        try:
            run.wait(timeout=180)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait(timeout=30)
        if tag is not None:  # any worker job of this run still queued (none after a clean stop)
            sched = SlurmScheduler(tmp / "jobs", tag=tag)
            sched.cancel([j.job_id for j in sched.jobs() if j.active])
        log.close()
        if started_slurm:
            stop_local_slurm(run_tag(run_dir))
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = summary["ledger"]
    res["lost_tasks"] = int(ledger["open"]) + sum(ledger.get("failed_by_reason", {}).values())
    res["ledger_states"] = ledger["states"]
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"accepted"' in x]
    last = steps[-1] if steps else {}
    res["admission"] = args.admission
    res["generated_per_trained"] = last.get("rollouts_generated", 0) / max(last.get("consumed", 0), 1)
    res["stale_drop_fraction"] = last.get("stale_dropped", 0) / max(last.get("rollouts_generated", 0), 1)
    res["trainer_steps"] = last.get("step", 0)
    res["ratio_throughput_add"] = ratio(res["traj_per_s_h100_a100"], res["traj_per_s_h100_only"])
    res["ratio_throughput_remove"] = ratio(res["traj_per_s_a100_only"], res["traj_per_s_h100_a100"])
    res["ratio_first_trajectory_slurm_vs_local"] = (
        res["seconds_to_first_trajectory"] / max(res["seconds_to_first_trajectory_local"], 1e-9))

    table = Table(title="elastic partitions (tiny model, local Slurm, this machine)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("trajectories/s, h100 only", f"{res['traj_per_s_h100_only']:.1f}"),
        ("add a100 (Slurm) -> first trajectory, s", f"{res['seconds_to_first_trajectory']:.1f}"),
        ("trajectories/s, h100 + a100", f"{res['traj_per_s_h100_a100']:.1f}"),
        ("add loc (local, baseline) -> first trajectory, s", f"{res['seconds_to_first_trajectory_local']:.1f}"),
        ("remove h100 --drain -> removed, s (CLI / orchestrator)",
         f"{res['seconds_to_drain']:.1f} / {res['drain_seconds_orchestrator']:.1f}"),
        ("trajectories/s, a100 only", f"{res['traj_per_s_a100_only']:.1f}"),
        ("lost tasks", str(res["lost_tasks"])),
        (f"admission {args.admission}: generated per trained, stale-dropped fraction",
         f"{res['generated_per_trained']:.2f} / {res['stale_drop_fraction']:.3f}"),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
