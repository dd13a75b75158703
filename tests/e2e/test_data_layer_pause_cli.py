"""The data layer's worker paused (SIGSTOP) for longer than the lease time, then continued: the
run rides it out and completes; every task ends once (the leases that expired meanwhile are
requeued, a late completion of one is still accepted once), the steps are contiguous."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter

import pytest

from tests.e2e.test_run_failure_cli import _completed, _pid, _running, _status_once

LEASE_S = 5.0


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_a_paused_data_layer_past_the_lease_time_is_ridden_out(tiny_model, tmp_path):
    steps = 10
    with _running(tmp_path, tiny_model, f"dataflow.lease_seconds={LEASE_S}", max_steps=steps, quiet=False
                  ) as (proc, run_dir):
        workers = _status_once(proc, run_dir, lambda st: 2 <= st["trainers"]["solver"]["version"] < steps - 4,
                               "v2")["workers"]
        victim = next(w for w in workers.values() if w["partition"] == "data" and w.get("phase") == "serving")
        os.kill(_pid(victim), signal.SIGSTOP)  # a worker this test's run started, by its PID
        try:
            time.sleep(3 * LEASE_S)
        finally:
            os.kill(_pid(victim), signal.SIGCONT)
        out, err = _completed(proc)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == {"solver": steps}
    train = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in train if x.get("policy") == "solver"] == list(range(1, steps + 1))
    assert summary["ledger"]["open"] == 0 and summary["ledger"]["states"]["consumed"] == 16 * steps
    journal = [json.loads(x) for x in (run_dir / "control" / "ledger.jsonl").read_text().splitlines()]
    created = Counter(x["t"] for x in journal if x["e"] == "created")
    ended = Counter(x["t"] for x in journal if x["e"] != "created")
    assert set(created.values()) == {1} and created.keys() == ended.keys() and set(ended.values()) == {1}
