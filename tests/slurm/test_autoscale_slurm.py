"""The autoscaler on the real local Slurm: an add becomes a new Slurm job of the partition, and
a drain cancels that job while the run goes on.

``astraflow run`` runs here with the data layer and the trainer as local workers and one rollout
partition on the Slurm partition ``h100`` (simulated nodes, so no model). The sim trainer is fast
from the start (it waits for rollouts: the autoscaler adds a worker, i.e. submits a job) and
slows down at step 10 (data is always ready: the autoscaler drains a worker, whose job is then
cancelled). The test watches ``squeue`` for the run's jobs (tagged with the run's comment).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from astraflow.runtime.reconcile import run_tag
from schedulers.slurm import SlurmScheduler
from storage.paths import RunPaths

ROOT = Path(__file__).resolve().parents[2]
ADDED = "rollout-h100-local-H100-1"


def _config(tmp_path: Path) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "sim" / "autoscale.yaml").read_text())
    # fast until step 10: at two workers the trainer consumes a few batches, so its demand there is
    # measured (the autoscaler's "load fell" needs it); then 20 slow steps: time for a window to see one end
    data["run"].update(max_steps=30, timeout_s=240)
    data["policies"][0]["trainer"].update(sim_step_seconds=0.05, sim_step_schedule={10: 3.0})
    data["cluster"].update(placement_timeout_s=120, worker_start_timeout_s=120)
    data["partitions"][2] = {
        "name": "h100", "scheduler": "slurm", "slurm_partition": "h100", "role": "rollout", "hardware": "H100",
        "nodes": 1, "cpus_per_node": 1, "mem": "2G", "walltime": "00:10:00",
        "autoscale": {"min_nodes": 1, "max_nodes": 2, "cooldown_s": 2},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _changes(run_dir: Path) -> list[dict]:
    f = run_dir / "control" / "autoscale.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def _wait(what: str, check, deadline_s: float, proc: subprocess.Popen, log: Path):
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    raise AssertionError(f"{what}: not within {deadline_s:.0f}s (run exit {proc.poll()}); run output:\n"
                         f"{log.read_text()[-4000:]}")


@pytest.mark.slurm
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_an_autoscale_add_submits_a_slurm_job_and_a_drain_cancels_it(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    sched = SlurmScheduler(tmp_path / "watch", tag=run_tag(RunPaths(run_dir)))
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "astraflow", "run", str(_config(tmp_path)), "--run-dir",
                                 str(run_dir)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        def added_job():
            return next((j for j in sched.jobs() if j.worker_name == ADDED and j.partition == "h100"), None)

        # 1. the fast trainer waits: an add, and a second Slurm job of the partition appears
        _wait("an autoscale add", lambda: any(c["action"] == "add" for c in _changes(run_dir)), 150, proc, log)
        job = _wait(f"a Slurm job for {ADDED}", added_job, 60, proc, log)
        add = _changes(run_dir)[0]
        assert (add["partition"], add["desired"], add["target"]) == ("h100", 1, 2), add
        # 2. it serves, then the slow trainer never waits: a drain, and that job is cancelled
        _wait("a drain", lambda: any(c["action"] == "drain" for c in _changes(run_dir)), 150, proc, log)
        _wait(f"job {job.job_id} cancelled", lambda: (j := added_job()) is None or not j.active, 60, proc, log)
        assert proc.poll() is None, "the drain cancelled the job while the run was still going"
        assert any(j.worker_name == "rollout-h100-local-H100-0" and j.active for j in sched.jobs())
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
        sched.cancel([j.job_id for j in sched.jobs() if j.active])  # none after a clean end

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    worker = summary["workers"][ADDED]
    assert worker["job_id"] == job.job_id and worker["served"] and worker["note"] == "drained", worker
    assert summary["data_layer"]["nodes"][ADDED]["completed"] > 0  # the added node generated
    assert [c["action"] for c in _changes(run_dir)][:2] == ["add", "drain"]
