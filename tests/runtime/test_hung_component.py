"""A trainer or data layer whose worker is connected but does not answer the orchestrator's
tick (hung, or paused with SIGSTOP) ends the run with one line naming it, its log and the resume
(what it was served is kept for the resume)."""

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
                           trainers={"solver": trainer}, fleet=SimpleNamespace(check_core=lambda wait_s: None))
    with pytest.raises(RunFailed) as err:
        Orchestrator._tick(orch)
    why = str(err.value)
    named = "the data layer" if hung == "data layer" else "the trainer of solver"
    assert why.startswith(f"{named} did not answer within 30 s, its worker still connected (hung: "), why
    assert "worker log under jobs/" in why and why.endswith("`astraflow run` on the run directory resumes it"), why
