"""A trainer or data layer whose worker is connected but does not answer the orchestrator's
tick (hung, or paused with SIGSTOP) is lost as a vanished one (its restart replaces it:
``tests/e2e/test_hung_worker_cli.py``); with no worker known for it, the run ends with one line
naming it, its log and the resume."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from astraflow.runtime.orchestrator import Orchestrator
from astraflow.runtime.workers import RunFailed


class _Silent:
    def result(self, timeout=None):
        raise TimeoutError()


class _Answers:
    def __init__(self, value):
        self.value = value

    def result(self, timeout=None):
        return self.value


@pytest.mark.parametrize("hung", ["data layer", "trainer"])
def test_a_hung_component_ends_the_run_naming_it_its_log_and_the_resume(hung):
    dl = SimpleNamespace(state=lambda evals=None: _Silent() if hung == "data layer" else _Answers({}))
    trainer = SimpleNamespace(state=lambda: _Silent())
    orch = SimpleNamespace(placement=SimpleNamespace(scheduler_gone=lambda: None), dl=dl,
                           trainers={"solver": trainer}, restarts=SimpleNamespace(placed_on={}),
                           fleet=SimpleNamespace(check_core=lambda wait_s: None, workers={}, of_role=lambda role: []))
    with pytest.raises(RunFailed) as err:
        Orchestrator._tick(orch)
    why = str(err.value)
    named = "the data layer" if hung == "data layer" else "the trainer of solver"
    assert why.startswith(f"{named} did not answer within 30 s, its worker still connected (hung: "), why
    assert "log under jobs/" in why and why.endswith("`astraflow run` on the run directory resumes it"), why


@pytest.mark.parametrize("hung", ["data layer", "trainer"])
def test_a_hung_components_worker_is_lost_as_a_vanished_one(hung):
    """The worker the silent component runs on goes to ``Fleet.lost`` (which raises ``TrainerLost``
    / ``DataLayerLost``: the restarts replace it), with the reason the run's log shows."""
    dl = SimpleNamespace(state=lambda evals=None: _Silent() if hung == "data layer" else _Answers({}))
    workers = {"data-0": SimpleNamespace(name="data-0", gone=False), "trainer-0": SimpleNamespace(name="trainer-0",
                                                                                                   gone=False)}
    lost = []

    def record(w, why):
        lost.append((w.name, why))
        raise LookupError("lost")  # stands for TrainerLost / DataLayerLost

    fleet = SimpleNamespace(check_core=lambda wait_s: None, workers=workers, lost=record,
                            of_role=lambda role: [workers["data-0"]] if role == "data" else [])
    orch = SimpleNamespace(placement=SimpleNamespace(scheduler_gone=lambda: None), dl=dl,
                           trainers={"solver": SimpleNamespace(state=lambda: _Silent())},
                           restarts=SimpleNamespace(placed_on={"solver": "trainer-0"}), fleet=fleet)
    with pytest.raises(LookupError):
        Orchestrator._tick(orch)
    named = "the data layer" if hung == "data layer" else "the trainer of solver"
    assert lost == [("data-0" if hung == "data layer" else "trainer-0",
                     f"{named} did not answer within 30 s, its worker still connected (hung: see its log under jobs/)")]
