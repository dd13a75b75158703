"""A data-layer worker killed mid-run, through the real CLI: the data layer is re-placed on a
new worker from its durable state, the trainer and the RaaS nodes reconnect, and the run
completes with nothing lost and nothing trained twice (every task created ends exactly once in
``control/ledger.jsonl``, the steps are contiguous, each committed step consumed one batch)."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter

import pytest

from tests.e2e.test_run_failure_cli import _completed, _alive, _pid, _running, _status_once


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_a_killed_data_layer_worker_is_replaced_and_the_run_completes_nothing_lost(tiny_model, tmp_path):
    steps = 14
    with _running(tmp_path, tiny_model, max_steps=steps, quiet=False) as (proc, run_dir):
        workers = _status_once(proc, run_dir, lambda st: 3 <= st["trainers"]["solver"]["version"] < steps - 4,
                               "v3")["workers"]
        victim = next(w for w in workers.values() if w["partition"] == "data" and w.get("phase") == "serving")
        os.kill(_pid(victim), signal.SIGKILL)  # a worker this test's run started, by its PID
        out, err = _completed(proc)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "data layer lost" in out and "re-placing it (1 of 2)" in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == {"solver": steps}
    (restart,) = summary["data_layer_restarts"]["restarts"]
    assert restart["new_worker"] != restart["worker"] and not restart["not_reconnected"], restart
    train = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in train if x.get("policy") == "solver"] == list(range(1, steps + 1))
    ledger = summary["ledger"]
    assert summary["ledger_closed"] and ledger["open"] == 0
    assert ledger["states"]["consumed"] == 16 * steps, ledger
    assert "served_not_trained" not in ledger["dropped_by_reason"], ledger
    journal = [json.loads(x) for x in (run_dir / "control" / "ledger.jsonl").read_text().splitlines()]
    created = Counter(x["t"] for x in journal if x["e"] == "created")
    ended = Counter(x["t"] for x in journal if x["e"] != "created")
    assert set(created.values()) == {1} and created.keys() == ended.keys() and set(ended.values()) == {1}
    assert sum(1 for x in journal if x["e"] == "consumed") == 16 * steps
    pids = [_pid(w) for w in summary["workers"].values()]
    assert len(pids) == len(workers) + 1 and not [p for p in pids if _alive(p)], "worker processes were left running"


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_in_sync_mode_a_killed_data_layer_ends_the_run_naming_it(tiny_model, tmp_path):
    """``run.mode: sync`` does not re-place the data layer: the run fails with one line that
    names it and says how to go on, not with a bare connection error."""
    with _running(tmp_path, tiny_model, "run.mode=sync", max_steps=40, quiet=False) as (proc, run_dir):
        workers = _status_once(proc, run_dir, lambda st: st["trainers"]["solver"]["version"] >= 2, "v2")["workers"]
        victim = next(w for w in workers.values() if w["partition"] == "data" and w.get("phase") == "serving")
        os.kill(_pid(victim), signal.SIGKILL)  # a worker this test's run started, by its PID
        out, err = _completed(proc)
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    assert "data layer" in err and "run.mode: sync does not re-place a lost data layer" in err, err[-3000:]
