"""A run whose rollout tasks all fail stops with their reasons (``stopping.NothingCompletes``),
read from the data layer's ledger summaries tick after tick."""

from __future__ import annotations

from astraflow.runtime.stopping import NothingCompletes


def summary(failed: int, completed: int, reasons: dict[str, int] | None = None) -> dict:
    return {"events": {"failed": failed, "completed": completed}, "failed_by_reason": reasons or {}}


def test_failures_with_no_completion_stop_the_run_naming_the_reasons():
    watch = NothingCompletes(limit=100)
    assert watch.check(summary(10, 0)) is None  # the first tick is the baseline
    assert watch.check(summary(109, 0)) is None
    why = watch.check(summary(110, 0, {"HFEngine.generate: prompt_tokens is empty": 90, "timeout": 20}))
    assert why.startswith("100 rollout tasks failed and none completed (90x HFEngine.generate: prompt_tokens")
    assert "20x timeout" in why and "jobs/" in why


def test_one_completion_disarms_it_for_good():
    watch = NothingCompletes(limit=100)
    watch.check(summary(0, 5))  # a resumed run's earlier completions are the baseline
    assert watch.check(summary(50, 6)) is None
    assert watch.check(summary(5000, 6)) is None and not watch.armed
