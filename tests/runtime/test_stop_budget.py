"""A stopped run's nodes keep to their share of ``cluster.stop_grace_s`` (``Shutdown._shutdown``):
a RaaS node still loading its model is not waited for (a stop sent to it would queue behind its
``start()`` on the worker's actor thread), and the nodes that are waited for share one deadline,
so that trainers and the data layer still get their time and do not show up in ``stop_errors``."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

from astraflow.runtime.monitoring import Tick
from astraflow.runtime.shutdown import Shutdown
from astraflow.runtime.stopping import Ending
from astraflow.runtime.workers import Worker
from schedulers import JobRef
from storage.paths import RunPaths
from tests.runtime.shutdown_fakes import FakeDataLayer, done

#: the run's stop budget in these tests; the trainer's answer takes a fraction of it
GRACE_S = 6.0
TRAINER_ANSWER_S = 1.0





class _Trainer:
    """Commits the step it is training: answers its stop a moment later."""

    def stop(self, timeout: float) -> Future:
        f: Future = Future()
        threading.Timer(TRAINER_ANSWER_S, f.set_result, [{"version": 3}]).start()
        return f


class _Node:
    """A RaaS node's actor handle; ``answers``: whether its stop comes back (a node still in its
    ``start()``, or a hung one, never answers here)."""

    def __init__(self, answers: bool):
        self.answers = answers
        self.stops: list[float] = []

    def stop(self, timeout: float) -> Future:
        self.stops.append(timeout)
        return done({"node": "n", "stopped": True, "error": None}) if self.answers else Future()


def _worker(name: str, phase: str, node: _Node, started: bool = True) -> Worker:
    w = Worker(JobRef(f"local-{name}", "rollout", name, "local", None), "rollout", actor=node)
    w.enter(phase, None if phase == "serving" else (done({"solver": 0}) if started else Future()))
    return w


class _Run(Shutdown):
    """Just what ``_shutdown`` reads of the orchestrator."""

    def __init__(self, root, workers: list[Worker]):
        self.cfg = SimpleNamespace(cluster=SimpleNamespace(stop_grace_s=GRACE_S))
        self.paths = RunPaths(root).make()
        self.fleet = SimpleNamespace(of_role=lambda role: workers if role == "rollout" else [])
        self.dl, self.trainers, self.iterations = FakeDataLayer(), {"solver": _Trainer()}, []
        self.last_tick = Tick(data_layer={}, trainers={"solver": {"version": 2}})
        self.summary: dict = {}
        self.status = SimpleNamespace(write_summary=lambda **kw: self.summary.update(kw),
                                      alive_while=lambda what: contextlib.nullcontext())


def _stop(tmp_path, workers: list[Worker]) -> tuple[_Run, float]:
    run = _Run(tmp_path / "run", workers)
    t0 = time.monotonic()
    run._shutdown(0.0, Ending("interrupted", "stopped by SIGINT (Ctrl-C)"))
    return run, time.monotonic() - t0


def test_a_node_still_loading_its_model_is_not_waited_for(tmp_path):
    loading, serving = _Node(answers=False), _Node(answers=True)
    run, took = _stop(tmp_path, [_worker("rollout-0", "starting", loading, started=False),
                                 _worker("rollout-1", "serving", serving)])
    assert loading.stops == [] and len(serving.stops) == 1
    errors = run.summary["stop_errors"]
    assert not any(k.startswith(("trainer", "data layer")) for k in errors), errors
    assert "node rollout-0" not in errors and run.summary["trainers"]["solver"] == {"version": 3}
    assert run.summary["nodes"]["rollout-0"]["stopped"] is False  # said so, not an error
    assert took < GRACE_S


def test_a_node_whose_start_returned_is_stopped_and_waited_for(tmp_path):
    """Its ``start()`` came back (the node may lease already) though the orchestrator's tick has
    not moved it on to serving: it flushes like any serving node."""
    node = _Node(answers=True)
    run, _ = _stop(tmp_path, [_worker("rollout-0", "starting", node, started=True)])
    assert len(node.stops) == 1 and run.summary["nodes"]["rollout-0"]["stopped"] is True


def test_nodes_that_do_not_answer_share_one_deadline(tmp_path):
    """Hung nodes are waited for together, not one after another (nor each for the least wait
    a call gets once the deadline has passed): the trainer still commits, the data layer closes."""
    nodes = [_Node(answers=False) for _ in range(10)]
    run, took = _stop(tmp_path, [_worker(f"rollout-{i}", "serving", n) for i, n in enumerate(nodes)])
    errors = run.summary["stop_errors"]
    assert {k for k in errors if k.startswith("node")} == {f"node rollout-{i}" for i in range(10)}
    assert not any(k.startswith(("trainer", "data layer")) for k in errors), errors
    assert run.summary["trainers"]["solver"] == {"version": 3}
    assert took < GRACE_S
