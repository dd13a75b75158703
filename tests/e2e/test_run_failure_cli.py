"""The one way out of a run, through the real CLI in a subprocess: a core worker killed mid-run
(the data layer's; a trainer's with its restarts off or spent), or SIGTERM reaching the head and
its local workers at once (what ``scancel`` of a head job does), ends the run within a few
seconds with a non-zero exit, one message line and no traceback; ``summary.json`` records how it
ended and no worker process is left behind. A trainer worker killed within its restarts is
replaced and the run completes: nothing lost, nothing trained twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tests.e2e.test_cli import ROOT, _write_config

#: how long the way out may take after the kill: the stop's grace (cluster.stop_grace_s) plus
#: cancelling the jobs and stopping the scheduler, with room for a loaded machine
EXIT_WITHIN_S = 45.0


@contextmanager
def _running(tmp_path: Path, tiny_model: Path, *sets: str, max_steps: int = 1000, quiet: bool = True,
             paced: bool = True) -> Iterator[tuple[subprocess.Popen, Path]]:
    """A paced run (each episode takes >= 0.5 s; ``paced`` False: as fast as the trainer) that
    would go on far longer than the test (unless ``max_steps`` says otherwise); ``sets``: more
    ``--set`` overrides. Killed on the way out if the test left it running."""
    cfg = _write_config(tmp_path, tiny_model)
    run_dir = tmp_path / "run"
    extra = [arg for s in sets for arg in ("--set", s)]
    pace = ["--set", "workload.workflow=tests.slurm.slow_workflow:slow_single_turn_test"] if paced else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "astraflow", "run", str(cfg), "--run-dir", str(run_dir), *(["--quiet"] if quiet else []),
         "--set", f"run.max_steps={max_steps}", "--set", "workload.eval.every=0", *pace, *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        yield proc, run_dir
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _status_once(proc: subprocess.Popen, run_dir: Path, ready, what: str, deadline_s: float = 150) -> dict:
    """The run's status file once ``ready(status)`` holds."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        f = run_dir / "control" / "status.json"
        try:
            st = json.loads(f.read_text()) if f.exists() else None
        except ValueError:  # being replaced right now
            st = None
        if st and ready(st):
            return st
        time.sleep(0.3)
    raise AssertionError(f"the run did not reach '{what}' in time")


def _workers_once_training(proc: subprocess.Popen, run_dir: Path, deadline_s: float = 150) -> dict[str, dict]:
    """The run's workers (from its status file) once its trainer has committed a version."""
    return _status_once(proc, run_dir, lambda st: any(t.get("version", 0) >= 1 for t in st["trainers"].values()),
                        "training", deadline_s)["workers"]


def _serving_trainer(workers: dict[str, dict]) -> dict:
    return next(w for w in workers.values() if w["partition"] == "trainer" and w["state"] != "GONE"
                and w.get("phase") == "serving")


def _pid(worker: dict) -> int:
    return int(worker["job_id"].removeprefix("local-"))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _completed(proc: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    """The run's stdout and stderr once it ended (killed, and the test failed, past ``timeout``)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # the CLI this test started, by its PID
        out, err = proc.communicate()
        raise AssertionError(f"the run did not end: {out[-3000:]}{err[-3000:]}") from None


def _finish(proc: subprocess.Popen, killed_at: float) -> tuple[int, list[str], str, float]:
    try:
        out, err = proc.communicate(timeout=EXIT_WITHIN_S + 60)
    except subprocess.TimeoutExpired:
        proc.kill()  # the CLI this test started, by its PID
        out, err = proc.communicate()
        raise AssertionError(f"the CLI did not exit: {err[-3000:]}")
    lines = [line for line in err.splitlines() if line.strip()]
    return proc.returncode, lines, out + err, time.monotonic() - killed_at


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("role", ["trainer", "data"])
def test_a_killed_core_worker_fails_the_run_in_one_line_with_a_summary(tiny_model, tmp_path, role):
    """The data layer's worker, or a trainer's, with their restarts off."""
    with _running(tmp_path, tiny_model, "cluster.trainer_restarts=0", "cluster.data_layer_restarts=0") as (proc, run_dir):
        workers = _workers_once_training(proc, run_dir)
        victim = next(w for w in workers.values() if w["partition"] == role)
        os.kill(_pid(victim), signal.SIGKILL)  # a worker this test's run started, by its PID
        rc, lines, everything, took = _finish(proc, time.monotonic())
    assert rc == 1, everything[-3000:]
    assert len(lines) == 1 and "Traceback" not in everything, everything[-3000:]
    what = "trainer worker" if role == "trainer" else "data-layer worker"
    assert lines[0].startswith(f"Error: the run failed: {what}") and "is gone" in lines[0], lines
    assert f"cluster.{'trainer' if role == 'trainer' else 'data_layer'}_restarts: 0" in lines[0], lines
    assert took < EXIT_WITHIN_S, f"the way out took {took:.0f}s"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"].startswith(what)
    if role == "trainer":  # the data layer was still there: it closed the ledger, every task ended once but
        # those of the batches served to the lost trainer, kept for the resume (not dropped as served_not_trained)
        assert summary["ledger_closed"] and summary["ledger"]["open"] == summary["ledger"]["kept_for_resume"]
        assert "served_not_trained" not in summary["ledger"]["dropped_by_reason"], summary["ledger"]
        assert "trainer solver" in summary["stop_errors"]
    else:  # the ledger could not be closed: the summary keeps the last one read, and says so
        assert not summary["ledger_closed"] and summary["ledger"]["tasks"] > 0
        assert "data layer finish" in summary["stop_errors"]
    assert not [n for n, w in workers.items() if _alive(_pid(w))], "worker processes were left running"


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_a_killed_trainer_worker_is_replaced_and_the_run_completes_nothing_lost_nothing_trained_twice(
        tiny_model, tmp_path):
    steps = 14
    with _running(tmp_path, tiny_model, "policies.0.trainer.optimizer_checkpoint_every=2", max_steps=steps,
                  quiet=False) as (proc, run_dir):
        workers = _status_once(proc, run_dir, lambda st: 3 <= st["trainers"]["solver"]["version"] < steps - 4,
                                "v3")["workers"]
        victim = _serving_trainer(workers)
        os.kill(_pid(victim), signal.SIGKILL)  # a worker this test's run started, by its PID
        out, err = _completed(proc)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "trainer solver lost" in out and "restarting it (1 of 2)" in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == {"solver": steps}
    (restart,) = summary["trainer_restarts"]["solver"]["restarts"]
    assert restart["worker"] == victim_name(workers, victim) and restart["new_worker"] != restart["worker"]
    assert restart["from_version"] >= 3 and restart["resumed_version"] == restart["from_version"]
    # a checkpoint every 2 steps: the moments lag the weights by at most a step, or (the trainer
    # killed between a step and its commit) a checkpoint newer than the weights is not used
    assert restart["optimizer_gap"] in (0, 1) or restart["optimizer_version"] is None, restart
    assert f"trainer solver restarted on {restart['new_worker']}" in (run_dir / "logs" / "orchestrator.log").read_text()
    train = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in train if x.get("policy") == "solver"] == list(range(1, steps + 1))  # no gap, no repeat
    ledger = summary["ledger"]
    assert summary["ledger_closed"] and ledger["open"] == 0
    # nothing trained twice, nothing lost: every committed step consumed one batch of tasks never
    # consumed before (a task ends once: the ledger asserts), and no served batch was dropped
    assert ledger["states"]["consumed"] == 16 * steps, ledger
    assert "served_not_trained" not in ledger["dropped_by_reason"], ledger
    assert summary["data_layer"]["counts"]["solver"]["consumed"] == 16 * steps
    assert summary["data_layer"]["trainer_restarts"] == {"solver": 1}
    pids = [int(w["job_id"].removeprefix("local-")) for w in summary["workers"].values()]
    assert len(pids) == len(workers) + 1 and not [p for p in pids if _alive(p)], "worker processes were left running"


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_a_trainer_worker_lost_during_the_start_is_replaced_and_the_run_completes(tiny_model, tmp_path, monkeypatch):
    """Killed by its own advantage module as the backend imports it (``tests/e2e/dying_trainer.py``):
    before v0 is published, while the RaaS nodes are being placed."""
    from tests.e2e.dying_trainer import DIE_ONCE_ENV

    died = tmp_path / "trainer-died"
    monkeypatch.setenv(DIE_ONCE_ENV, str(died))
    steps = 4
    with _running(tmp_path, tiny_model, "policies.0.trainer.advantage=tests.e2e.dying_trainer:grpo_after_a_death",
                  max_steps=steps, quiet=False, paced=False) as (proc, run_dir):
        out, err = _completed(proc)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert died.exists(), "the trainer worker was not killed: the test tested nothing"
    assert "trainer solver lost" in out and "restarting it (1 of 2) from v0" in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == {"solver": steps}
    (restart,) = summary["trainer_restarts"]["solver"]["restarts"]
    assert restart["from_version"] == 0 and restart["new_worker"] != restart["worker"], restart
    train = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in train if x.get("policy") == "solver"] == list(range(1, steps + 1))
    assert summary["ledger_closed"] and summary["ledger"]["open"] == 0
    assert summary["ledger"]["states"]["consumed"] == 16 * steps, summary["ledger"]
    pids = [int(w["job_id"].removeprefix("local-")) for w in summary["workers"].values()]
    assert int(died.read_text()) in pids and not [p for p in pids if _alive(p)], "worker processes were left running"


def victim_name(workers: dict[str, dict], victim: dict) -> str:
    return next(n for n, w in workers.items() if w is victim)


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_a_run_failed_on_a_lost_trainer_resumes_and_trains_the_batches_served_to_it(tiny_model, tmp_path):
    """Unpaced, the trainer is the bottleneck: when it is killed a batch served to it is in training.
    The run fails keeping that batch; the resume puts it back and trains it: the audit finds nothing lost."""
    from benchmarks.chaos_audit import audit_run

    with _running(tmp_path, tiny_model, "cluster.trainer_restarts=0", paced=False) as (proc, run_dir):
        victim = _serving_trainer(_workers_once_training(proc, run_dir))
        os.kill(_pid(victim), signal.SIGKILL)  # a worker this test's run started, by its PID
        rc, _, everything, _ = _finish(proc, time.monotonic())
    assert rc == 1, everything[-3000:]
    first = json.loads((run_dir / "summary.json").read_text())
    ledger = first["ledger"]
    assert "served_not_trained" not in ledger["dropped_by_reason"] and ledger["open"] == ledger["kept_for_resume"]
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    # the newest committed version (one more when the trainer died between a commit and its report)
    assert first["steps"]["solver"] >= max(steps), (first["steps"], steps[-3:])
    final = first["steps"]["solver"] + 3
    resume = [sys.executable, "-m", "astraflow", "run", str(tmp_path / "config.yaml"), "--run-dir", str(run_dir),
              "--quiet", "--set", f"run.max_steps={final}", "--set", "workload.eval.every=0"]
    again = subprocess.run(resume, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    audit = audit_run(run_dir, final)
    assert audit["ok"] and not audit["lost_trajectories"], audit["problems"]


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_a_trainer_worker_killed_past_its_restarts_fails_the_run_naming_the_limit(tiny_model, tmp_path):
    with _running(tmp_path, tiny_model, "cluster.trainer_restarts=1") as (proc, run_dir):
        first = _serving_trainer(_workers_once_training(proc, run_dir))
        os.kill(_pid(first), signal.SIGKILL)  # a worker this test's run started, by its PID

        def restarted_and_training(st: dict) -> bool:
            r = st.get("trainer_restarts", {}).get("solver", {}).get("restarts", [])
            return bool(r) and st["trainers"]["solver"]["version"] > r[0]["from_version"]

        workers = _status_once(proc, run_dir, restarted_and_training, "restarted")["workers"]
        second = _serving_trainer(workers)
        assert second["job_id"] != first["job_id"]
        os.kill(_pid(second), signal.SIGKILL)
        rc, lines, everything, took = _finish(proc, time.monotonic())
    assert rc == 1, everything[-3000:]
    assert len(lines) == 1 and "Traceback" not in everything, everything[-3000:]
    assert lines[0].startswith("Error: the run failed: trainer worker") and "is gone" in lines[0], lines
    assert "already restarted 1 time(s)" in lines[0] and "cluster.trainer_restarts: 1" in lines[0], lines
    assert took < EXIT_WITHIN_S, f"the way out took {took:.0f}s"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["trainer_restarts"]["solver"]["count"] == 1
    assert summary["ledger_closed"] and summary["ledger"]["open"] == summary["ledger"]["kept_for_resume"]
    assert not [n for n, w in workers.items() if _alive(_pid(w))], "worker processes were left running"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_sigterm_to_the_head_and_its_workers_stops_in_one_line_with_a_summary(tiny_model, tmp_path):
    """What ``scancel`` of a head job does: SIGTERM to every process of the job at once, so the
    stop finds its data layer and trainer gone and must still write the summary and exit."""
    with _running(tmp_path, tiny_model) as (proc, run_dir):
        workers = _workers_once_training(proc, run_dir)
        killed_at = time.monotonic()
        for w in workers.values():  # processes this test's run started, by their PIDs
            if w["partition"] in ("data", "trainer"):
                os.kill(_pid(w), signal.SIGTERM)
        os.kill(proc.pid, signal.SIGTERM)
        rc, lines, everything, took = _finish(proc, killed_at)
    assert rc == 130, everything[-3000:]
    assert len(lines) == 1 and "Traceback" not in everything, everything[-3000:]
    assert lines[0].startswith("the run was stopped by SIGTERM") and "summary.json" in lines[0], lines
    assert took < EXIT_WITHIN_S, f"the way out took {took:.0f}s"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["reason"] == "stopped by SIGTERM"
    assert summary["steps"]["solver"] >= 1  # from the last state read: the trainer was gone
    assert not [n for n, w in workers.items() if _alive(_pid(w))], "worker processes were left running"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_ctrl_c_again_during_the_stop_does_not_break_it(tiny_model, tmp_path):
    """A user who presses Ctrl-C again while the run stops: the stop goes on (a note says so),
    the summary is written and the run exits 130 without a traceback."""
    with _running(tmp_path, tiny_model) as (proc, run_dir):
        workers = _workers_once_training(proc, run_dir)
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        # again and again while it stops (signals that arrive before the handler runs count once;
        # a loaded machine may not run it for a while)
        until = time.monotonic() + 3
        while proc.poll() is None and time.monotonic() < until:
            time.sleep(0.1)
            os.kill(proc.pid, signal.SIGINT)
        rc, lines, everything, took = _finish(proc, killed_at)
    assert rc == 130, everything[-3000:]
    assert "Traceback" not in everything and "Aborted" not in everything, everything[-3000:]
    assert lines[-1].startswith("the run was stopped by SIGINT (Ctrl-C or `astraflow stop`)"), lines
    assert "summary.json" in lines[-1], lines
    assert lines[:-1] and all(line.startswith("already stopping") for line in lines[:-1]), lines
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["ledger_closed"]
    assert not [n for n, w in workers.items() if _alive(_pid(w))], "worker processes were left running"
