"""Failed rollout tasks show on the progress line while the run runs, and a run that ends with
more tasks failed than trained on says so, with the commonest reason and where the tracebacks are."""

from __future__ import annotations

import io
import time

import pytest

from rich.console import Console

from astraflow.runtime.monitoring.writer import Tick
from astraflow.runtime.progress import Progress, failures_outnumber_consumed

REASON = "failed:EpisodeError: tool ping raised ValueError: tool broke (after 3 attempts)"


def _line(ledger: dict) -> str:
    buf = io.StringIO()
    progress = Progress(console=Console(file=buf, force_terminal=False, width=300, highlight=False), interval_s=0)
    state = {"eval": [], "staleness_hist": {}, "nodes": {}, "episodes_per_s": 1.0, "generated_tokens_per_s": 10.0,
             "ledger": ledger}
    progress.update(Tick(data_layer=state, trainers={"agent": {"version": 3, "last_metrics": {}}}))
    return buf.getvalue()


def test_the_progress_line_shows_failed_tasks_and_the_commonest_reason():
    line = _line({"events": {"failed": 213, "consumed": 96}, "failed_by_reason": {REASON: 207, "failed:other": 6}})
    assert "213 tasks failed (failed:EpisodeError: tool ping raised ValueError: tool broke" in line
    assert "failed" not in _line({"events": {"consumed": 96}, "failed_by_reason": {}})


def test_the_end_of_run_warns_when_more_tasks_failed_than_were_consumed():
    ledger = {"events": {"failed": 213, "consumed": 96}, "failed_by_reason": {REASON: 207, "failed:other": 6}}
    warning = failures_outnumber_consumed(ledger, "/runs/r/jobs")
    assert warning == (f"more rollout tasks failed (213) than were trained on (96); the commonest reason: {REASON} "
                       "(the tracebacks are in the RaaS nodes' logs under /runs/r/jobs)")
    assert failures_outnumber_consumed({"events": {"failed": 5, "consumed": 96}}, "/j") is None


# rich's own refresh thread dies on the closed terminal too; it draws nothing else
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_terminal_that_hangs_up_during_a_wait_leaves_the_stop_as_it_was():
    """SIGHUP while a spinner is drawn: the stop's KeyboardInterrupt comes out of the wait, not
    the OSError of drawing on the closed terminal (the run would be recorded as failed)."""
    import os
    import pty

    from astraflow.runtime.progress import _Console

    master, slave = pty.openpty()
    term = os.fdopen(slave, "w", buffering=1)
    progress = Progress(console=_Console(file=term, force_terminal=True, highlight=False, soft_wrap=True))
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGHUP"):
            with progress.waiting("waiting for 3 workers to join"):
                time.sleep(1.2)  # the spinner is drawn
                os.close(master)  # the terminal hangs up
                master = None
                time.sleep(1.2)  # the spinner draws on it
                raise KeyboardInterrupt("SIGHUP")
        assert not progress.enabled  # nothing more is drawn there
        progress.note("after the hang-up")  # and a note does not raise
    finally:
        if master is not None:
            os.close(master)
        try:
            term.close()  # what it still buffers cannot reach the closed terminal
        except OSError:
            pass
