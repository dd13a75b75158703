"""The head job survives its walltime by requeueing itself, on the real local Slurm.

`jobs/astraflow-head.sbatch` runs a paced run (data layer and trainer in the head job, one
Slurm rollout worker). While it trains, the test sends what Slurm sends before the walltime
(``--signal=B:USR1@300``: SIGUSR1 to the batch shell only, here ``scancel --signal=USR1
--batch``). The run stops cleanly (its summary says requeue, its worker job is cancelled), the
script requeues the job, and its second incarnation resumes on the same run directory and
finishes: versions go on from where they stopped, each step is trained and logged once. The
pacing only keeps the first incarnation from finishing before the signal: once the job is
requeued the test ends it, and the resumed incarnation trains at the tiny model's pace.

A requeued job waits for Slurm's credential lifetime before it may start again (120 s by
default; a job started sooner is refused); tests/slurm/local_slurm.sh sets it to 15 s.

A resume also cancels the Slurm jobs a previous incarnation left active, found by the run's
tag, and leaves alone a job that only shares a worker name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from astraflow.runtime.jobrecords import cancel_previous_jobs
from astraflow.runtime.progress import Progress
from astraflow.runtime.reconcile import run_tag
from astraflow.sections import ClusterConfig
from schedulers import Partition
from schedulers.slurm import SlurmScheduler, run_slurm
from storage.paths import RunPaths
from tests.slurm.slow_workflow import PACE_OFF_ENV, end_pacing
from tests.slurm.test_elastic import ROOT, _status, _wait

MAX_STEPS = 20


def _config(tmp_path: Path, model: Path) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "elastic" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(model)
    data["policies"][0].pop("init", None)
    data["run"].update(max_steps=MAX_STEPS, timeout_s=300)
    data["workload"]["eval"]["every"] = 0
    # paced: 8 episodes in flight, 0.5 s each -> about one step (16 sequences) per second
    data["workload"]["workflow"] = "tests.slurm.slow_workflow:slow_single_turn_test"
    data["rollout"].update(capacity=8, flush_seconds=0.5)
    data["cluster"].update(placement_timeout_s=180, worker_start_timeout_s=180)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _job(job_id: str) -> dict:
    return next((j for j in json.loads(run_slurm(["squeue", "--json", "--states=all"]))["jobs"]
                 if str(j["job_id"]) == job_id), {})


def _summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):  # not written yet, or being replaced
        return None


@pytest.mark.slurm
@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_the_walltime_warning_requeues_the_head_job_and_the_run_resumes(tiny_model, tmp_path):
    run_dir, head_log, pace_off = tmp_path / "run", tmp_path / "head.log", tmp_path / "pace-off"
    head = run_slurm([
        "sbatch", "--parsable", "--partition=cpu", "--cpus-per-task=1", "--mem=1G", "--time=00:10:00",
        f"--output={head_log}", f"--error={head_log}", f"--chdir={ROOT}",
        f"--export=ALL,ASTRAFLOW_PYTHON={sys.executable},{PACE_OFF_ENV}={pace_off}",
        str(ROOT / "jobs" / "astraflow-head.sbatch"), str(_config(tmp_path, tiny_model)), str(run_dir),
    ]).strip().split(";")[0]
    tag = run_tag(RunPaths(run_dir))
    try:
        st = _wait("3 steps trained", lambda: (s := _status(run_dir)) and s["trainers"]["solver"]["version"] >= 3 and s,
                   200, head_log)
        first_jobs = {w["job_id"] for w in st["workers"].values() if w["kind"] == "slurm"}
        assert first_jobs
        run_slurm(["scancel", "--signal=USR1", "--batch", head])  # what --signal=B:USR1@300 sends
        _wait("the head job requeued", lambda: _job(head).get("restart_cnt", 0) >= 1, 90, head_log)
        first = _summary(run_dir)
        # the first incarnation has stopped where it was: the resumed one needs no pacing
        end_pacing(pace_off)
        _wait("the resumed run to finish", lambda: (s := _summary(run_dir)) and s["status"] == "completed", 240,
              head_log, interval=1.0)
        _wait("the head job to end", lambda: _job(head).get("job_state") == "COMPLETED", 60, head_log)
    finally:
        run_slurm(["scancel", head])
        sched = SlurmScheduler(tmp_path / "jobs", tag=tag)  # whatever worker jobs of the run are left
        sched.cancel([j.job_id for j in sched.jobs() if j.active])

    log = head_log.read_text()
    assert "incarnation 1" in log and f"requeueing job {head} (requeue 1 of at most 10)" in log, log[-3000:]
    assert "incarnation 2" in log, log[-3000:]
    # the first incarnation stopped cleanly for the requeue
    assert first["status"] == "interrupted" and first["requeue"] is True and "walltime" in first["reason"], first
    # open: only the tasks of a batch served and not committed, kept for the resume
    assert first["ledger_closed"] and first["ledger"]["open"] == first["ledger"]["kept_for_resume"], first["ledger"]
    stopped_at = first["steps"]["solver"]
    assert 3 <= stopped_at < MAX_STEPS, f"the run is too fast for this test (v{stopped_at}): raise MAX_STEPS"
    archived = [json.loads(p.read_text()) for p in run_dir.glob("summary.*.json")]
    assert [s["reason"] for s in archived] == [first["reason"]]
    # the second one resumed there and finished
    final = _summary(run_dir)
    assert final["steps"] == {"solver": MAX_STEPS} and not final["requeue"] and final["ledger"]["open"] == 0
    assert final["previous_jobs"] == {"cancelled": [], "errors": {}}  # checked; the clean stop had left nothing
    assert _job(head)["restart_cnt"] == 1
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps == list(range(1, MAX_STEPS + 1)), steps
    versions = sorted(int(p.name[1:]) for p in (run_dir / "weights" / "solver").glob("v*"))
    assert versions[-1] == MAX_STEPS
    # no worker job of either incarnation is left (cancelled ones show COMPLETING for a moment)
    sched = SlurmScheduler(tmp_path / "jobs", tag=tag)
    ids = [j.job_id for j in sched.jobs()]
    assert first_jobs <= set(ids)
    final_states = sched.wait_for(ids, ["CANCELLED", "COMPLETED", "FAILED"], deadline_s=30)
    assert all(not j.active for j in final_states.values()), final_states


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_a_resume_cancels_the_jobs_its_previous_incarnation_left_and_no_other(tmp_path):
    paths = RunPaths(tmp_path / "run").make()
    part = Partition(name="h100", scheduler="slurm", slurm_partition="h100", role="rollout", walltime="5")
    previous = SlurmScheduler(paths.jobs, tag=run_tag(paths), death_timeout=120)
    # a worker job of the previous incarnation: it waits for a scheduler that is gone
    [left] = previous.submit(part, "tcp://127.0.0.1:9", 1)
    # someone else's job that only shares the worker name (no tag: not this run's)
    other = run_slurm(["sbatch", "--parsable", "--partition=cpu", "--time=5", f"--job-name={left.worker_name}",
                       f"--output={tmp_path / 'other.log'}", "--wrap", "sleep 300"]).strip().split(";")[0]
    notes: list[str] = []
    progress = Progress(enabled=False)
    progress.note = notes.append
    try:
        previous.wait_for([left.job_id], ["RUNNING"], deadline_s=30)
        found = cancel_previous_jobs(paths, ClusterConfig(), [part], progress)
        assert [(j["job_id"], j["kind"], j["worker"]) for j in found.cancelled] == [(left.job_id, "slurm", left.worker_name)]
        assert len(notes) == 1 and f"cancelled slurm job {left.job_id}" in notes[0], notes
        assert previous.wait_for([left.job_id], ["CANCELLED"], deadline_s=30)
        assert _job(other).get("job_state") in ("PENDING", "RUNNING")  # untouched
    finally:
        run_slurm(["scancel", left.job_id, other])


def _slow_to_end(tmp_path: Path, paths: RunPaths, part: Partition, index: int) -> str:
    """A job of the run's tag, named as a worker of ``part``, whose shell takes 3 s to exit
    after SIGTERM (as a worker finishing a write would; Slurm's KillWait here is 5 s)."""
    from schedulers.partition import worker_name

    return run_slurm(["sbatch", "--parsable", f"--partition={part.slurm_partition}", "--time=5",
                      f"--comment={run_tag(paths)}", f"--job-name={worker_name(part, index)}",
                      f"--output={tmp_path / f'slow-{index}.log'}",
                      "--wrap", "trap 'sleep 3; exit 0' TERM; while true; do sleep 0.2; done"]).strip().split(";")[0]


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_a_resume_waits_until_the_cancelled_jobs_have_ended(tmp_path, monkeypatch):
    """A cancelled job's processes run on until they exit: the resume goes on only once they
    have ended (a worker of the previous incarnation must not write into the run directory the
    next one cleans up), and a job that does not end in time stops the resume, named."""
    import time

    import astraflow.runtime.reconcile as reconcile
    from astraflow.runtime.workers import RunFailed

    paths = RunPaths(tmp_path / "run").make()
    part = Partition(name="h100", scheduler="slurm", slurm_partition="h100", role="rollout", walltime="5")
    jobs = SlurmScheduler(paths.jobs, tag=run_tag(paths))
    slow, slower = _slow_to_end(tmp_path, paths, part, 0), None
    try:
        jobs.wait_for([slow], ["RUNNING"], deadline_s=30)
        t0 = time.monotonic()
        found = cancel_previous_jobs(paths, ClusterConfig(), [part], Progress(enabled=False))
        assert [j["job_id"] for j in found.cancelled] == [slow]
        assert time.monotonic() - t0 >= 2.0, "returned while the cancelled job was still ending"
        assert _job(slow).get("job_state") not in ("PENDING", "RUNNING", "COMPLETING")

        slower = _slow_to_end(tmp_path, paths, part, 1)
        jobs.wait_for([slower], ["RUNNING"], deadline_s=30)
        run_scheduler = reconcile.run_scheduler

        def impatient(*args, **kwargs):
            backend = run_scheduler(*args, **kwargs)
            backend.cancel_wait_s = 0.5
            return backend

        monkeypatch.setattr(reconcile, "run_scheduler", impatient)
        with pytest.raises(RunFailed, match=f"have not ended.*{slower}.*squeue"):
            cancel_previous_jobs(paths, ClusterConfig(), [part], Progress(enabled=False))
    finally:
        run_slurm(["scancel", slow, *([slower] if slower else [])])
