"""A run that ends with more rollout tasks failed than trained on says so once (``Shutdown._shutdown``):
as a progress note, or as a log warning under ``--quiet`` (no progress output); not at all when
the run fails for its failing tasks, whose failure line already says so."""

from __future__ import annotations

import contextlib
import io
import logging
from types import SimpleNamespace

import pytest
from rich.console import Console

from astraflow.runtime.progress import Progress
from astraflow.runtime.shutdown import Shutdown
from astraflow.runtime.stopping import Ending, NothingCompletes
from storage.paths import RunPaths
from tests.runtime.shutdown_fakes import FakeDataLayer

LEDGER = {"events": {"failed": 373, "consumed": 0}, "failed_by_reason": {"failed:EpisodeError: reward raised": 373}}





class _Run(Shutdown):
    """Just what ``_shutdown`` reads of the orchestrator, with a progress writing to ``out``."""

    def __init__(self, root, enabled: bool):
        self.out = io.StringIO()
        self.progress = Progress(enabled=enabled, console=Console(file=self.out, width=400, highlight=False))
        self.cfg = SimpleNamespace(cluster=SimpleNamespace(stop_grace_s=2.0))
        self.paths = RunPaths(root).make()
        self.fleet = SimpleNamespace(of_role=lambda role: [])
        self.dl, self.trainers, self.last_tick, self.iterations = FakeDataLayer(LEDGER, with_ledger_in_state=True), {}, None, []
        self.status = SimpleNamespace(write_summary=lambda **kw: None,
                                      alive_while=lambda what: contextlib.nullcontext())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "more rollout tasks failed" in r.getMessage()]


def test_with_progress_output_the_warning_is_one_progress_note(tmp_path, caplog):
    run = _Run(tmp_path / "run", enabled=True)
    with caplog.at_level(logging.WARNING, logger="astraflow.runtime"):
        run._shutdown(0.0, Ending("completed"))
    assert run.out.getvalue().count("more rollout tasks failed (373) than were trained on (0)") == 1
    assert _warnings(caplog) == []


def test_under_quiet_the_warning_is_one_log_line(tmp_path, caplog):
    run = _Run(tmp_path / "run", enabled=False)
    with caplog.at_level(logging.WARNING, logger="astraflow.runtime"):
        run._shutdown(0.0, Ending("interrupted", "stopped by SIGINT (Ctrl-C)"))
    assert run.out.getvalue() == ""
    assert len(_warnings(caplog)) == 1


def _failing_tasks_reason(completed: int) -> str:
    watch = NothingCompletes(limit=256)
    watch.check({"events": {"failed": 0, "completed": completed}})
    return watch.check({"events": {"failed": 373, "completed": completed},
                        "failed_by_reason": LEDGER["failed_by_reason"]})


@pytest.mark.parametrize("completed", [0, 5], ids=["none-completed", "none-since"])
@pytest.mark.parametrize("enabled", [True, False], ids=["progress", "quiet"])
def test_a_run_failing_for_its_failing_tasks_does_not_repeat_it(tmp_path, caplog, enabled, completed):
    run = _Run(tmp_path / "run", enabled=enabled)
    with caplog.at_level(logging.WARNING, logger="astraflow.runtime"):
        run._shutdown(0.0, Ending("failed", _failing_tasks_reason(completed)))
    assert "more rollout tasks failed" not in run.out.getvalue()
    assert _warnings(caplog) == []


def test_a_run_failing_for_another_reason_still_warns(tmp_path, caplog):
    run = _Run(tmp_path / "run", enabled=True)
    with caplog.at_level(logging.WARNING, logger="astraflow.runtime"):
        run._shutdown(0.0, Ending("failed", "run deadline of 600s passed (run.timeout_s)"))
    assert run.out.getvalue().count("more rollout tasks failed (373)") == 1
