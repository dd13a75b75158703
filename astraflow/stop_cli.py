"""``astraflow stop RUN_DIR``: stop a live run from another shell, the way Ctrl-C stops it.

The run's ``astraflow run`` process holds the directory's lock and wrote who it is there (pid,
host, start time: ``runtime.runlock``). ``stop`` checks that this process still lives on this
host (a pid reused since by another process is not signalled), sends it SIGINT (nodes flush
what they wrote, trainers commit, the summary is written, the worker jobs are cancelled) and
waits until the run let go of the directory, then says how it ended.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import click

from astraflow.clibase import Seconds, UserError, UserPath, shell_arg
from astraflow.runtime.runlock import holder_of
from storage.holds import pid_alive
from storage.paths import RunPaths


#: seconds a run's process may seem to have started after it took its lock (the wall clock,
#: which the lock's time is on, stepped since: NTP after a VM resume)
CLOCK_SLACK_S = 120.0


def process_started_at(pid: int) -> float | None:
    """When process ``pid`` of this host started (unix time; None: unknown or gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` of this host (``T``: stopped; None: unknown or gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def live_holder(run_dir: Path) -> dict:
    """The ``astraflow run`` holding ``run_dir``, checked to be alive on this host; ``UserError``
    naming the way on when there is none or it runs elsewhere."""
    holder = holder_of(run_dir)
    if not holder.get("pid"):
        if not RunPaths(run_dir).run_lock.exists():
            raise UserError(f"{run_dir} is not a run directory (no `astraflow run` has used it): pass the "
                            "--run-dir of `astraflow run`")
        raise UserError(f"no run is running in {run_dir} (its lock names no holder): nothing to stop")
    pid, host = int(holder["pid"]), holder.get("host")
    if host != socket.gethostname():
        job = holder.get("slurm_job")
        how = (f"`scancel {job}` (its head job: it stops the same way)" if job
               else "`scancel` its head job (which stops it the same way)")
        raise UserError(f"the run in {run_dir} runs on host {host} (pid {pid}): run `astraflow stop` there, or {how}")
    started = process_started_at(pid)
    # a pid reused since the run died: a process younger than the run's lock (with a margin for
    # a clock stepped since)
    if not pid_alive(pid) or (started is not None and started > float(holder.get("started", 0)) + CLOCK_SLACK_S):
        raise UserError(f"no run is running in {run_dir}: the run that held it (pid {pid}) is gone; "
                        "`astraflow run` on the directory resumes it")
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmdline = ""
    if "astraflow" not in cmdline:  # another program, or a run started from a script of the user's
        shown = cmdline.strip()[:120] or "its command line is unreadable"
        raise UserError(f"pid {pid}, which holds {run_dir}, does not look like `astraflow run` ({shown}): if it "
                        f"is the run, `kill -INT {pid}` stops it the same way")
    if _holds(pid, RunPaths(run_dir).run_lock) is False:  # a lock file naming another run's process
        raise UserError(f"pid {pid}, which {run_dir}'s lock names, does not hold that lock (another run's "
                        "process, or a lock file written by hand): not stopping it")
    return holder


def _holds(pid: int, lock: Path) -> bool | None:
    """Whether process ``pid`` has the file ``lock`` open, as the run holding it does; None where
    its descriptors cannot be read."""
    try:
        want = os.stat(lock)
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            return True
    return False


@click.command("stop")
@click.argument("run_dir", type=UserPath(file_okay=False, exists=True))
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until the run has stopped and say how it ended.")
@click.option("--timeout", type=Seconds(), default=300.0, show_default=True,
              help="Seconds to wait for the stop (it takes about cluster.stop_grace_s at most).")
def stop(run_dir: str, wait: bool, timeout: float) -> None:
    """Stop the run in RUN_DIR as Ctrl-C in its terminal would: RaaS nodes flush what they wrote,
    trainers commit, summary.json is written and the worker jobs are cancelled. `astraflow run`
    on the directory resumes it. Run it on the host of the run's `astraflow run` (under Slurm,
    `scancel` of the head job does the same)."""
    rd = Path(run_dir)
    holder = live_holder(rd)
    pid = int(holder["pid"])
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        raise UserError(f"the run in {rd} (pid {pid}) ended meanwhile") from None
    except PermissionError:
        raise UserError(f"the run in {rd} (pid {pid}) is another user's: only its owner can stop it") from None
    click.echo(f"stopping the run in {rd} (pid {pid})")
    if not wait:
        return
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and holder_of(rd).get("pid") == pid:
        if time.monotonic() > deadline:
            raise click.ClickException(f"the run (pid {pid}) is still stopping after {timeout:.0f}s; "
                                       f"`astraflow status {shell_arg(rd)}` shows what it waits for")
        time.sleep(0.5)
    click.echo(_ended(rd, holder.get("slurm_job")))


def _ended(rd: Path, slurm_job: str | None = None) -> str:
    """How the stopped run ended, from its summary, and how to resume it (a run that ran in a
    Slurm head job: by submitting the head job again on the directory)."""
    from astraflow.runtime.monitoring.text import outcome

    resume = (f"`sbatch jobs/astraflow-head.sbatch CONFIG {shell_arg(rd)}` (or `astraflow run` on it) resumes it"
              if slurm_job else f"`astraflow run` on {rd} resumes it")
    try:
        summary = json.loads(RunPaths(rd).summary.read_text())
    except (OSError, ValueError):
        return f"the run stopped without a summary; {resume}"
    steps = ", ".join(f"{p} at step {n}" for p, n in (summary.get("steps") or {}).items())
    return (f"the run ended {outcome(summary)}" + (f" ({summary['reason']})" if summary.get("reason") else "")
            + (f", {steps}" if steps else "") + f"; {resume}")
