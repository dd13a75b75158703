"""The orchestrator's way out (``Shutdown._shutdown``) with stand-ins for the components: the
data layer learns whether the run reached its end (one that did not keeps its served, uncommitted
batches for the resume), and ``summary.json``'s ``steps`` are the newest committed versions in
the weight store, not the last tick of a trainer that was lost."""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from astraflow.runtime.monitoring import Tick
from astraflow.runtime.shutdown import Shutdown
from astraflow.runtime.stopping import Ending
from storage.paths import RunPaths
from tests.runtime.shutdown_fakes import FakeDataLayer, done
from storage.weights import WeightStore





class _LostTrainer:
    def stop(self, timeout: float):
        raise RuntimeError("its worker is gone")  # the handle of a lost worker raises at once


class _Run(Shutdown):
    """Just what ``_shutdown`` reads of the orchestrator."""

    def __init__(self, root, dl, trainers, last_tick):
        self.cfg = SimpleNamespace(cluster=SimpleNamespace(stop_grace_s=1.0))
        self.paths = RunPaths(root).make()
        self.fleet = SimpleNamespace(of_role=lambda role: [])
        self.dl, self.trainers, self.last_tick, self.iterations = dl, trainers, last_tick, []
        self.summary: dict = {}
        self.status = SimpleNamespace(write_summary=lambda **kw: self.summary.update(kw),
                                      alive_while=lambda what: contextlib.nullcontext())


@pytest.mark.parametrize("ending, completed", [
    (Ending("failed", "trainer worker ... is gone; restarting its trainer is off"), False),
    (Ending("interrupted", "stopped by Ctrl-C"), False),
    (Ending("interrupted", "stopped by SIGUSR1 for a requeue", requeue=True), False),
    (Ending("completed"), True),
], ids=["lost-trainer", "ctrl-c", "requeue", "completed"])
def test_the_data_layer_learns_whether_the_run_reached_its_end(tmp_path, ending, completed):
    dl = FakeDataLayer()
    run = _Run(tmp_path / "run", dl, {"solver": _LostTrainer()},
               Tick(data_layer={}, trainers={"solver": {"version": 0}}))
    run._shutdown(0.0, ending)
    assert dl.finished_with == [completed]


def test_the_summary_steps_are_the_newest_committed_version_not_a_lost_trainers_last_tick(tmp_path):
    run = _Run(tmp_path / "run", FakeDataLayer(), {"solver": _LostTrainer()},
               Tick(data_layer={}, trainers={"solver": {"version": 23}}))  # ticked before v24, v25 were committed
    store = WeightStore(run.paths.weights, keep_last=10)
    for v in (23, 24, 25):
        store.publish("solver", v, {"w": torch.zeros(2)})
    result = run._shutdown(0.0, Ending("failed", "trainer worker ... is gone"))
    assert run.summary["steps"] == result.steps == {"solver": 25}
    assert "trainer solver" in run.summary["stop_errors"]


class _LostDataLayer(FakeDataLayer):
    def state(self) -> Future:
        raise RuntimeError("Worker holding Actor was lost")


def test_a_data_layer_lost_at_the_end_leaves_every_recorded_evaluation_in_the_summary(tmp_path):
    """A tick carries the newest evaluations only; when the data layer cannot answer at the end,
    the summary's are those ``metrics.jsonl`` recorded (the last line of a version recorded twice)."""
    import json

    evals = [{"policy": "solver", "step": v, "eval_accuracy": v / 200, "eval_prompts": 4} for v in range(200)]
    tick = Tick(data_layer={"eval": evals[-80:]}, trainers={"solver": {"version": 199}})
    run = _Run(tmp_path / "run", _LostDataLayer(), {"solver": _LostTrainer()}, tick)
    again = dict(evals[5], eval_accuracy=0.5)  # v5 recorded again, by a re-placed data layer
    lines = [*evals[:10], {"policy": "solver", "step": 3, "loss": 0.1}, again, *evals[10:]]
    run.paths.metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = run._shutdown(0.0, Ending("failed", "data layer lost"))
    assert [e["step"] for e in result.eval] == list(range(200))
    assert result.eval[5]["eval_accuracy"] == 0.5 and run.summary["data_layer"]["eval"] == result.eval


class _ResumedDataLayer(FakeDataLayer):
    """A data layer that is not durable, resumed at v5: it knows only its own evaluations."""

    def state(self) -> Future:
        return done({"eval": [{"policy": "solver", "step": v, "eval_accuracy": 0.1, "eval_prompts": 4}
                              for v in (5, 6)]})


def test_a_resumed_run_whose_data_layer_is_not_durable_keeps_its_earlier_evaluations(tmp_path):
    """``dataflow.durable: false``: the resumed data layer starts without the evaluations of the
    incarnation before, which ``metrics.jsonl`` recorded; the summary (and the run's closing
    "held-out accuracy (v0) -> (vN)" line) has them all, not only the resumed ones."""
    import json

    run = _Run(tmp_path / "run", _ResumedDataLayer(), {"solver": _LostTrainer()},
               Tick(data_layer={}, trainers={"solver": {"version": 6}}))
    earlier = [{"policy": "solver", "step": v, "eval_accuracy": 0.0, "eval_prompts": 4} for v in (0, 2, 4)]
    run.paths.metrics.write_text("".join(json.dumps(x) + "\n" for x in earlier))  # the first incarnation's
    result = run._shutdown(0.0, Ending("completed"))
    assert [e["step"] for e in result.eval] == [0, 2, 4, 5, 6] == [e["step"] for e in run.summary["data_layer"]["eval"]]


class _SlowToFinish(FakeDataLayer):
    """A data layer that closes its ledger slowly; it records what `status` said meanwhile."""

    def __init__(self, root):
        super().__init__()
        self.root, self.seen = root, None

    def finish(self, completed: bool = True) -> Future:
        from astraflow.runtime.monitoring import format_status, run_status

        deadline = time.time() + 5
        while (st := run_status(self.root)).get("waiting") is None and time.time() < deadline:
            time.sleep(0.05)
        self.seen = format_status(st)
        return super().finish(completed)


def test_status_says_the_run_is_stopping_while_it_stops(tmp_path):
    """A stop can outlast `STALE_AFTER_S` (nodes flushing, engines closing): meanwhile the last
    status is written on and says so, from the stop's start, not "running" as if nothing
    happened, nor "busy or hung" once it ages; the summary then ends it for every reader."""
    from astraflow.runtime.monitoring import build_status_view, write_orchestrator_info
    from tests.monitoring.test_status_files import _tick, _writer

    dl = _SlowToFinish(tmp_path / "run")
    run = _Run(tmp_path / "run", dl, {}, _tick(1))
    run.status, _ = _writer(run.paths)
    write_orchestrator_info(run.paths, None, None)
    run.status.write(_tick(1))
    run._shutdown(time.time(), Ending("interrupted", "stopped by Ctrl-C"))
    assert dl.seen is not None and "now: stopping: the run interrupted (stopped by Ctrl-C) (for 0s)" in dl.seen, dl.seen
    view = build_status_view(run.paths.root)
    assert view.finished and view.outcome == "interrupted" and view.waiting is None
