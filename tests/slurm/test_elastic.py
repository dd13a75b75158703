"""Elastic partitions end to end, on the real local Slurm, through the head job a user submits.

`jobs/astraflow-head.sbatch` runs the whole run inside a Slurm job (data layer and trainer as
local workers of the head job, RaaS nodes as Slurm worker jobs). While it trains, the test
uses the real CLI against the run directory: a second partition is added and produces
trajectories, a bad one is refused without harming the run, the first is removed with a drain,
one worker job is cancelled from outside with `scancel`, and the run still finishes its steps
with every task ended exactly once.

Pacing: every episode takes at least 0.5 s (a test-only workflow, `slow_workflow.py`) and a
node runs `rollout.capacity` (4) at once, so a trainer step (16 sequences) takes about 2 s per
serving node whatever the CPU speed; `max_steps` is chosen so the run cannot end before the
last action (the test checks that, and says so if it ever fails). The added partition has two nodes, so cancelling
one leaves the run a serving node while the replacement loads. Once the last action is done the
test ends the pacing: the remaining steps only show that the run finishes, at the tiny model's pace.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from astraflow.cli import main
from schedulers.slurm import SlurmScheduler, run_slurm
from storage.trajectories import EntryRef, open_trajectory_store
from tests.slurm.slow_workflow import PACE_OFF_ENV, end_pacing

ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 100


def _status(run_dir: Path) -> dict | None:
    f = run_dir / "control" / "status.json"
    return json.loads(f.read_text()) if f.exists() else None


def _wait(what: str, check, deadline_s: float, head_log: Path, interval: float = 0.3):
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    tail = head_log.read_text()[-3000:] if head_log.exists() else "(no head log)"
    raise AssertionError(f"{what} not within {deadline_s:.0f}s; head job log:\n{tail}")


def _cli(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, list(args))
    return res.exit_code, res.output


def _config(tmp_path: Path, model: Path) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "elastic" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(model)
    data["policies"][0].pop("init", None)
    data["run"].update(max_steps=MAX_STEPS, timeout_s=500)
    data["workload"]["eval"]["every"] = 0
    # paced: 4 episodes in flight per node, 0.5 s each -> ~0.5 step (16 sequences) per second
    # per node, whatever the machine (see slow_workflow.py)
    data["workload"]["workflow"] = "tests.slurm.slow_workflow:slow_single_turn_test"
    data["dataflow"].update(lease_seconds=15, prefetch_groups=2)
    data["rollout"].update(capacity=4, flush_seconds=0.5)
    data["cluster"].update(placement_timeout_s=180, worker_start_timeout_s=180, drain_timeout_s=30)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slurm
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_partitions_added_removed_and_killed_mid_run_lose_no_task(tiny_model, tmp_path):
    run_dir, head_log = tmp_path / "run", tmp_path / "head.log"
    config = _config(tmp_path, tiny_model)
    pace_off = tmp_path / "pace-off"
    head = run_slurm([
        "sbatch", "--parsable", "--partition=cpu", "--cpus-per-task=1", "--mem=1G", "--time=00:10:00",
        f"--output={head_log}", f"--error={head_log}", f"--chdir={ROOT}",
        f"--export=ALL,ASTRAFLOW_PYTHON={sys.executable},{PACE_OFF_ENV}={pace_off}",
        str(ROOT / "jobs" / "astraflow-head.sbatch"), str(config), str(run_dir),
    ]).strip().split(";")[0]
    tag = None
    try:
        # 1. the run comes up with one Slurm rollout partition (h100) and it serves
        st = _wait("h100 serving", lambda: (s := _status(run_dir)) and s["partitions"]["h100"]["serving"] >= 1 and s,
                   150, head_log)
        tag = st["tag"]
        assert st["partitions"]["data"]["scheduler"] == "local" and st["partitions"]["h100"]["scheduler"] == "slurm"
        # every Dask connection of the run is mutual TLS, the Slurm workers' included, and the CLI,
        # which only reads and writes the run directory, works all the same
        assert json.loads((run_dir / "control" / "orchestrator.json").read_text())["scheduler"].startswith("tls://")
        code, out = _cli("status", str(run_dir))
        assert code == 0 and "h100" in out, out
        # the run names its head job: the one to scancel from a login node, where `astraflow stop` cannot signal it
        assert json.loads((run_dir / "control" / "orchestrator.json").read_text())["slurm_job"] == head
        assert f", Slurm job {head})" in out, out

        # 2. a bad request is refused with exit 2 and leaves the run alone
        code, out = _cli("partitions", "add", str(run_dir), "bad", "--slurm-partition", "nosuch", "--wait", "20")
        assert code == 2 and "invalid partition" in out.lower() and "withdrawn" in out, out

        # 3. a second partition joins mid-run and its nodes produce trajectories
        code, out = _cli("partitions", "add", str(run_dir), "a100", "--slurm-partition", "a100", "--nodes", "2",
                         "--hardware", "A100", "--mem", "2G")
        assert code == 0 and "submitted:" in out, out
        _wait("trajectories from a100", lambda: (s := _status(run_dir)) and s["partitions"]["a100"]["completed"] > 0,
              240, head_log)

        # 4. the first partition is removed with a drain (the real CLI, as a subprocess)
        proc = subprocess.run([sys.executable, "-m", "astraflow", "partitions", "remove", str(run_dir), "h100",
                               "--drain", "--wait", "60"], capture_output=True, text=True, timeout=90, cwd=ROOT)
        assert proc.returncode == 0 and "removed in" in proc.stdout, proc.stdout + proc.stderr
        st = _status(run_dir)
        assert st["partitions"]["h100"]["state"] == "removed" and st["partitions"]["h100"]["removal_mode"] == "drain"
        version = st["trainers"]["solver"]["version"]
        assert version <= MAX_STEPS - 10, f"the run is too fast for this test (v{version}): raise MAX_STEPS"

        # 5. one a100 worker job is cancelled from outside: noticed, its tasks requeued, refilled
        victim_name = st["partitions"]["a100"]["workers"][0]
        victim = st["workers"][victim_name]["job_id"]
        run_slurm(["scancel", victim])
        _wait("the lost a100 worker replaced",
              lambda: (s := _status(run_dir)) and s["workers"][victim_name]["phase"] == "gone"
              and len(s["partitions"]["a100"]["workers"]) == 2, 120, head_log)

        # 6. the replacement serves (or, on a machine slow to start it, the paced run ends first);
        # then the run finishes its steps, no longer paced: nothing is left to see mid-run
        _wait("the replacement a100 worker serving or the run finished",
              lambda: (run_dir / "summary.json").exists()
              or ((s := _status(run_dir)) and s["partitions"]["a100"]["serving"] == 2), 150, head_log)
        end_pacing(pace_off)
        _wait("the run to finish", lambda: (run_dir / "summary.json").exists(), 300, head_log, interval=1.0)
    finally:
        run_slurm(["scancel", head])
        if tag is not None:  # whatever worker jobs of this run are left (none after a clean end)
            sched = SlurmScheduler(tmp_path / "jobs", tag=tag)
            sched.cancel([j.job_id for j in sched.jobs() if j.active])

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == {"solver": MAX_STEPS} and not summary["interrupted"]
    ledger = summary["ledger"]
    assert ledger["open"] == 0, ledger  # every task ended exactly once (the ledger asserts on a second end)
    assert ledger["states"].get("consumed", 0) >= MAX_STEPS * 16
    parts = summary["partitions"]
    assert parts["h100"]["state"] == "removed" and parts["bad"]["state"] == "removed" and parts["bad"]["error"]
    assert parts["a100"]["state"] == "active"
    note = summary["workers"][victim_name]["note"]  # whichever the orchestrator saw first
    assert summary["workers"][victim_name]["phase"] == "gone" and ("CANCELLED" in note or "left" in note), note
    assert any(n.startswith("rollout-a100-") and n.endswith("-2") for n in summary["workers"])
    # provenance: trajectories in the store came from both Slurm partitions
    store = open_trajectory_store(str(run_dir / "trajectories"), "r")
    entries = store.read([EntryRef(s, i) for s in store.segments() for i in range(store.count(s))])
    seen = {json.loads(e.meta).get("provenance", {}).get("partition") for e in entries}
    assert {"h100", "a100"} <= seen, seen
    # the head job ended by itself, and no worker job of this run is left
    # (a cancelled job shows COMPLETING for a moment while Slurm cleans up: wait with a deadline)
    sched = SlurmScheduler(tmp_path / "jobs", tag=tag)
    ids = [j.job_id for j in sched.jobs()]
    final = sched.wait_for(ids, ["CANCELLED", "COMPLETED", "FAILED"], deadline_s=30)
    assert all(not j.active for j in final.values()), final
