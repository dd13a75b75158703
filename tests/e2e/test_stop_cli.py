"""``astraflow stop RUN_DIR`` from another shell stops a live run the Ctrl-C way (summary, no
worker left) and says how it ended; with no live run it says so and signals nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from storage.paths import RunPaths
from tests.e2e.test_cli import ROOT
from tests.e2e.test_run_failure_cli import _alive, _pid, _running, _workers_once_training


def _stop(run_dir, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "astraflow", "stop", str(run_dir), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_stop_from_another_shell_stops_the_run_with_a_summary(tiny_model, tmp_path):
    with _running(tmp_path, tiny_model) as (proc, run_dir):
        workers = _workers_once_training(proc, run_dir)
        done = _stop(run_dir)
        assert proc.wait(60) == 130
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout.splitlines()
    assert out[0] == f"stopping the run in {run_dir} (pid {proc.pid})"
    assert out[1].startswith("the run ended interrupted (stopped by SIGINT (Ctrl-C or `astraflow stop`)), solver at step ")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["ledger_closed"]
    assert not [n for n, w in workers.items() if _alive(_pid(w))], "worker processes were left running"
    again = _stop(run_dir)  # nothing runs there now
    assert again.returncode == 2 and "no run is running in" in again.stderr


def test_stop_signals_nothing_without_a_live_run_of_this_host(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    res = _stop(run_dir)  # a directory no run has used
    assert res.returncode == 2 and "is not a run directory" in res.stderr and "--run-dir" in res.stderr, res.stderr
    lock = RunPaths(run_dir).run_lock
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text("")
    assert "its lock names no holder" in _stop(run_dir).stderr
    # a run that died without letting go: its pid is free now (or another program's)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": time.time()}))
    res = _stop(run_dir)
    assert res.returncode == 2 and f"the run that held it (pid {dead.pid}) is gone" in res.stderr
    # a process younger than the lock (a pid reused since) is not signalled
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time() - 3600}))
    res = _stop(run_dir)
    assert res.returncode == 2 and "is gone" in res.stderr
    # nor one that is not `astraflow run` (a `sleep` this test started, by its pid)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        lock.write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname(), "started": time.time()}))
        res = _stop(run_dir)
        assert res.returncode == 2 and "does not look like `astraflow run` (sleep 60)" in res.stderr
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
    # nor an `astraflow` process that does not hold this lock (a lock file naming another run's)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "astraflow", "run"])
    try:
        lock.write_text(json.dumps({"pid": other.pid, "host": socket.gethostname(), "started": time.time() + 5}))
        res = _stop(run_dir)
        assert res.returncode == 2 and "does not hold that lock" in res.stderr, res.stderr
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
    lock.write_text(json.dumps({"pid": 1234, "host": "another-host", "started": time.time()}))
    res = _stop(run_dir)
    assert res.returncode == 2 and "runs on host another-host (pid 1234)" in res.stderr and "scancel" in res.stderr


def test_stop_from_another_host_names_the_head_job_to_scancel(tmp_path, monkeypatch):
    """On a Slurm cluster `astraflow stop` runs on a login node, never the head job's node: it
    cannot signal the run there, so it names the head job the run records (`SLURM_JOB_ID`), and
    a second run on the directory (and `status`) name it too."""
    from astraflow.runtime.monitoring.text import _who
    from astraflow.runtime.runlock import RunDirError, RunDirLock

    run_dir = tmp_path / "run"
    monkeypatch.setenv("SLURM_JOB_ID", "4321")
    with RunDirLock(run_dir):
        holder = json.loads(RunPaths(run_dir).run_lock.read_text())
        assert holder["slurm_job"] == "4321" and holder["pid"] == os.getpid(), holder
        with pytest.raises(RunDirError, match=r"in Slurm job 4321, .*`scancel 4321`"):
            RunDirLock(run_dir).acquire()
    assert _who({"pid": 7, "host": "node17", "slurm_job": "4321"}) == " (pid 7 on node17, Slurm job 4321)"
    RunPaths(run_dir).run_lock.write_text(json.dumps(
        {"pid": 1234, "host": "another-host", "started": time.time(), "slurm_job": "4321"}))
    res = _stop(run_dir)
    assert res.returncode == 2 and "runs on host another-host (pid 1234)" in res.stderr, res.stderr
    assert "`scancel 4321` (its head job" in res.stderr, res.stderr


def test_a_stopped_head_jobs_run_is_resumed_by_submitting_the_head_job_again(tmp_path):
    """The line after a stop says how to resume: under Slurm the head job is submitted again on
    the directory (``astraflow run`` there would run on the login node)."""
    from astraflow.stop_cli import _ended

    run_dir = tmp_path / "my run"
    RunPaths(run_dir).make()
    assert _ended(run_dir, "4321").endswith(
        f"`sbatch jobs/astraflow-head.sbatch CONFIG '{run_dir}'` (or `astraflow run` on it) resumes it")
    assert _ended(run_dir).endswith(f"`astraflow run` on {run_dir} resumes it")
