"""Failed rollout tasks show on the progress line while the run runs, and a run that ends with
more tasks failed than trained on says so, with the commonest reason and where the tracebacks are."""

from __future__ import annotations

import io

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
