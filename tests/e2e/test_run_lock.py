"""One `astraflow run` per run directory: a second run on a directory a live run holds exits 2
naming that run and the fix; the lock dies with its holder, so a crashed run leaves none behind
and running again on the directory (a resume) works."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from astraflow.runtime.runlock import RunDirError, RunDirLock
from tests.e2e.test_cli import _write_config

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "astraflow", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_a_held_directory_is_refused_naming_the_holder_until_released(tmp_path):
    with RunDirLock(tmp_path / "run"):
        with pytest.raises(RunDirError) as err:
            RunDirLock(tmp_path / "run").acquire()
        msg = str(err.value)
        assert f"pid {os.getpid()} on host {socket.gethostname()}, started " in msg
        assert "another --run-dir" in msg and "resume" in msg
    with RunDirLock(tmp_path / "run") as again:  # released: free for the next run
        assert again.held


def test_the_refusal_names_the_command_that_stops_the_holder(tmp_path, monkeypatch):
    """Outside Slurm there is no job to cancel: the way to stop the live run is `astraflow stop`;
    a run in a head job is also stopped by cancelling that job, which is named."""
    run_dir = tmp_path / "my run"
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with RunDirLock(run_dir):
        with pytest.raises(RunDirError) as err:
            RunDirLock(run_dir).acquire()
    assert f"`astraflow stop '{run_dir}'`" in str(err.value) and "scancel" not in str(err.value), err.value
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with RunDirLock(run_dir):
        with pytest.raises(RunDirError) as err:
            RunDirLock(run_dir).acquire()
    assert "`astraflow stop" in str(err.value) and "`scancel 4242`, its Slurm job" in str(err.value), err.value


def test_the_lock_dies_with_a_killed_holder(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom astraflow.runtime.runlock import RunDirLock\n"
         "RunDirLock(sys.argv[1]).acquire()\nprint('held', flush=True)\ntime.sleep(120)", str(run_dir)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match=f"pid {holder.pid} "):
            RunDirLock(run_dir).acquire()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with RunDirLock(run_dir) as lock:  # no stale lock: a crashed run's directory can be resumed
        assert lock.held
        assert json.loads((run_dir / "control" / "run.lock").read_text())["pid"] == os.getpid()


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_second_run_is_refused_while_the_first_holds_the_directory_and_runs_after(tiny_model, tmp_path):
    cfg, run_dir = _write_config(tmp_path, tiny_model), tmp_path / "run"
    with RunDirLock(run_dir):  # a live run holds the directory (this process stands in for it)
        second = _cli("run", str(cfg), "--run-dir", str(run_dir), "--set", "run.max_steps=2", "--quiet")
    assert second.returncode == 2, second.stdout[-3000:] + second.stderr[-3000:]
    errors = [line for line in second.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in errors[0] and "another --run-dir" in errors[0]
    assert not (run_dir / "summary.json").exists() and not (run_dir / "weights").exists()  # nothing started
    released = _cli("run", str(cfg), "--run-dir", str(run_dir), "--set", "run.max_steps=2", "--quiet",
                    "--set", "workload.eval.every=0")
    assert released.returncode == 0, released.stdout[-3000:] + released.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps == [1, 2]
    # a run refused on a directory that holds a run leaves it as it was: still a resume away
    kept = {f: (run_dir / f).read_bytes() for f in ("metrics.jsonl", "summary.json", "config.yaml")}
    with RunDirLock(run_dir):
        again = _cli("run", str(cfg), "--run-dir", str(run_dir), "--set", "run.max_steps=3", "--quiet")
    assert again.returncode == 2 and "another --run-dir" in again.stderr, again.stderr[-3000:]
    assert {f: (run_dir / f).read_bytes() for f in kept} == kept
