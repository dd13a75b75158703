"""A trainer's or the data layer's worker that stays connected but stops answering (paused with
SIGSTOP, as a process stuck in the kernel or a deadlock looks from outside), through the real
CLI: after the orchestrator's tick waits out its deadline, the worker is cancelled (SIGKILL
reaches a stopped process) and replaced as a lost one, and the run completes with every step
trained once."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.e2e.test_run_failure_cli import _alive, _completed, _pid, _running, _status_once


@pytest.mark.e2e
@pytest.mark.timeout(480)
@pytest.mark.parametrize("role", ["trainer", "data"])
def test_a_hung_core_worker_is_replaced_and_the_run_completes(tiny_model, tmp_path, role):
    steps = 10
    with _running(tmp_path, tiny_model, max_steps=steps, quiet=False) as (proc, run_dir):
        workers = _status_once(proc, run_dir, lambda st: 2 <= st["trainers"]["solver"]["version"] < steps - 4,
                               "v2")["workers"]
        victim = next(w for w in workers.values() if w["partition"] == role and w.get("phase") == "serving")
        os.kill(_pid(victim), signal.SIGSTOP)  # a worker this test's run started, by its PID
        try:
            out, err = _completed(proc, timeout=360)
        finally:
            if _alive(_pid(victim)):  # the run should have killed it; never leave a stopped process behind
                os.kill(_pid(victim), signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    asked = "the trainer of solver" if role == "trainer" else "the data layer"
    assert f"{asked} did not answer within 30 s, its worker still connected (hung" in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == {"solver": steps}
    (restart,) = (summary["trainer_restarts"]["solver"] if role == "trainer" else summary["data_layer_restarts"])[
        "restarts"]
    assert "did not answer" in restart["why"] and restart["new_worker"] != restart["worker"], restart
    train = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in train if x.get("policy") == "solver"] == list(range(1, steps + 1))
    ledger = summary["ledger"]
    assert summary["ledger_closed"] and ledger["open"] == 0 and ledger["states"]["consumed"] == 16 * steps, ledger
    pids = [_pid(w) for w in summary["workers"].values()]
    assert not [p for p in pids if _alive(p)], "worker processes were left running"
