"""`astraflow status` on run directories older AstraFlow versions wrote: a summary from before
``status`` existed reads its outcome from ``interrupted``, and the dashboard's token file is
named only where it exists."""

from __future__ import annotations

import pytest

from astraflow.runtime.monitoring.text import format_status, format_summary
from storage.paths import RunPaths
from tests.monitoring.test_damaged_status import _status


@pytest.mark.parametrize("interrupted, shown", [(True, "interrupted"), (False, "completed")])
def test_a_summary_without_status_reads_its_outcome_from_interrupted(interrupted, shown):
    old = {"steps": {"solver": 13}, "seconds": 21.4, "interrupted": interrupted, "ledger": {"tasks": 3}}
    first = format_summary(old, "run/summary.json").splitlines()[0]
    assert first == f"run finished: {shown} after 21s", first


def test_a_summary_with_status_says_it_and_one_with_neither_says_it_does_not_know():
    said = format_summary({"status": "failed", "interrupted": False, "reason": "boom"}, "s.json")
    assert said.startswith("run finished: failed (boom)")
    assert format_summary({"seconds": 3}, "s.json").startswith("run finished: ? after 3s")


def test_a_resumed_runs_summary_says_its_seconds_are_its_last_incarnations():
    """``seconds`` is how long the last `astraflow run` ran; a resumed run trained for longer in all
    (the data layer's run time), which is said beside it. A run that was not resumed: its seconds alone."""
    resumed = {"status": "interrupted", "seconds": 41.5, "data_layer": {"elapsed_s": 84.1}}
    assert format_summary(resumed, "s.json").splitlines()[0] == (
        "run finished: interrupted after 42s (its last incarnation; 84s of run time in all)")
    single = {"status": "completed", "seconds": 20.2, "data_layer": {"elapsed_s": 11.0}}
    assert format_summary(single, "s.json").splitlines()[0] == "run finished: completed after 20s"


def test_the_dashboard_token_file_is_named_only_where_it_exists(tmp_path):
    paths = RunPaths(tmp_path / "run").make()
    st = {**_status(paths), "orchestrator": {"dashboard": "http://127.0.0.1:1/status"}}
    first = format_status(st).splitlines()[0]
    assert first.endswith("dashboard http://127.0.0.1:1/status") and "with the token" not in first, first
    url = paths.security / "dashboard.url"
    url.parent.mkdir(parents=True, exist_ok=True)
    url.write_text("http://127.0.0.1:1/astraflow?token=x\n")
    first = format_status(st).splitlines()[0]
    assert first.endswith(f"(with the token in {url})"), first


def test_status_json_reads_an_old_summary_s_outcome_as_the_text_does(tmp_path):
    """``status --json`` (the view) and the text agree on a summary without ``status``."""
    import json

    from astraflow.runtime.monitoring.view import build_status_view

    (tmp_path / "summary.json").write_text(json.dumps({"interrupted": True, "seconds": 21.0, "steps": {}}))
    assert build_status_view(tmp_path).outcome == "interrupted"
