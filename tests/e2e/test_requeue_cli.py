"""Stopping for a requeue and resuming, through the real CLI without Slurm: SIGUSR1 (what the
head job passes on from Slurm's walltime warning) stops the run the clean way and exits 75 with a
summary that says ``requeue``; running again on the directory resumes where it stopped, after
cancelling a worker process the previous incarnation left running (recorded in its job records).
The Slurm path (the head job requeueing itself) is tests/slurm/test_requeue.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from astraflow.runtime.jobrecords import JobRecords
from schedulers import LocalScheduler, Partition
from storage.paths import RunPaths
from tests.e2e.test_run_failure_cli import ROOT, _finish, _running, _workers_once_training

MAX_STEPS = 12


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_sigusr1_stops_for_a_requeue_and_the_resume_cancels_what_was_left(tiny_model, tmp_path):
    slow = ["--set", "workload.eval.every=0", "--set", "workload.workflow=tests.slurm.slow_workflow:slow_single_turn_test"]
    with _running(tmp_path, tiny_model, max_steps=MAX_STEPS) as (proc, run_dir):
        _workers_once_training(proc, run_dir)
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGUSR1)
        rc, lines, everything, _ = _finish(proc, killed_at)
    assert rc == 75, everything[-3000:]
    assert len(lines) == 1 and lines[0].startswith("the run was stopped by SIGUSR1 for a requeue"), lines
    first = json.loads((run_dir / "summary.json").read_text())
    assert first["status"] == "interrupted" and first["requeue"] is True and "walltime" in first["reason"]
    assert first["ledger_closed"] and not first["stop_errors"], first  # a clean stop: every component answered
    stopped_at = first["steps"]["solver"]
    assert 1 <= stopped_at < MAX_STEPS, f"the run is too fast for this test (v{stopped_at}): raise MAX_STEPS"

    # a worker the previous incarnation left (as if its orchestrator had died before cancelling
    # it): a real local worker process, recorded as that incarnation recorded its own
    leftover = LocalScheduler(run_dir / "jobs", death_timeout=120)
    [left] = leftover.submit(Partition(name="extra", role="rollout"), "tcp://127.0.0.1:9", 1)
    JobRecords(RunPaths(run_dir)).add([left])
    try:
        resumed = subprocess.run(
            [sys.executable, "-m", "astraflow", "run", str(tmp_path / "config.yaml"), "--run-dir", str(run_dir),
             "--set", f"run.max_steps={MAX_STEPS}", *slow],
            cwd=ROOT, capture_output=True, text=True, timeout=300)
        worker_rc = leftover._procs[left.job_id].popen.poll()
    finally:
        leftover.close()
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert worker_rc is not None, "the leftover worker was not stopped"
    assert f"cancelled local job {left.job_id} ({left.worker_name}, RUNNING" in resumed.stdout

    final = json.loads((run_dir / "summary.json").read_text())
    assert final["status"] == "completed" and final["steps"] == {"solver": MAX_STEPS} and not final["requeue"]
    assert [j["job_id"] for j in final["previous_jobs"]["cancelled"]] == [left.job_id]
    archived = [json.loads(p.read_text()) for p in run_dir.glob("summary.*.json")]
    assert [s["requeue"] for s in archived] == [True]
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps == list(range(1, MAX_STEPS + 1)), steps  # resumed where it stopped: no step lost or repeated
