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


def test_failures_after_completions_stop_the_run_too():
    """Tasks completed, then every one fails (weights gone bad after some steps): the failures
    since the last completion count, and the reasons named are theirs."""
    watch = NothingCompletes(limit=100)
    watch.check(summary(0, 5))  # a resumed run's earlier completions are the baseline
    assert watch.check(summary(50, 6, {"timeout": 50})) is None  # a completion: counting starts again
    assert watch.check(summary(149, 6, {"timeout": 50, "nan logits": 99})) is None
    why = watch.check(summary(150, 6, {"timeout": 50, "nan logits": 100}))
    assert why.startswith("100 rollout tasks failed since the last one completed (100x nan logits)")


def test_failures_among_completions_do_not_stop_the_run():
    watch = NothingCompletes(limit=100)
    for tick in range(1, 50):
        assert watch.check(summary(90 * tick, tick)) is None
