"""A node's failed episodes do not flood its log (the workers' logs are never rotated): the first
failure of a reason is logged with its traceback, the later ones are counted and said in one
line per reason at most once a minute, and what is still counted is said when the node stops.
The clock is the test's own."""

from __future__ import annotations

import logging
import re

from astraflow.rollout.failure_log import FailureLog, reason_of


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _failure_lines(caplog):
    return [r for r in caplog.records if r.name == "astraflow.rollout" and "failed" in r.getMessage()]


def _counted(lines, reason):
    """The failures the count lines say for ``reason``."""
    return sum(int(m.group(1)) for r in lines
               for m in [re.match(r"node n0: (\d+) more episodes? failed in the last [\d.]+ s: (.*)$", r.getMessage())]
               if m and m.group(2) == reason)


def test_a_reward_failing_often_writes_a_line_a_minute_saying_how_many(caplog):
    clock = Clock()
    failures = FailureLog("n0", clock=clock)
    with caplog.at_level(logging.WARNING, logger="astraflow.rollout"):
        for i in range(600):  # 600 failures over 5 minutes: one every half second
            try:
                raise ValueError("reward failed\nsecond line differs per task %d" % i)
            except ValueError as err:
                failures.failed(f"g{i}/0", err)
                where = f"ValueError {reason_of(err)[1]}"  # raised here, its messages differ: one reason
            clock.now += 0.5
        lines = _failure_lines(caplog)
        assert lines[0].exc_info is not None and lines[0].getMessage().startswith("episode g0/0 failed: ValueError")
        assert all(r.exc_info is None for r in lines[1:])  # one traceback per reason
        assert 4 <= len(lines) - 1 <= 5, [r.getMessage() for r in lines]  # at most one line a minute
        failures.flush()  # the node stops
    lines = _failure_lines(caplog)
    assert _counted(lines, where) == 599  # every failure after the first is said
    assert f"failed in the last 60.0 s: {where}" in lines[1].getMessage()


def test_reasons_are_counted_apart_and_a_quiet_one_is_said_when_due_or_at_the_stop(caplog):
    clock = Clock()
    failures = FailureLog("n0", clock=clock)
    with caplog.at_level(logging.WARNING, logger="astraflow.rollout"):
        for i in range(3):
            failures.failed(f"a{i}", KeyError("missing"))
            failures.failed(f"b{i}", TimeoutError("tool timed out"))
        assert len(_failure_lines(caplog)) == 2  # the two first tracebacks, the rest counted
        clock.now += 30
        failures.flush(due_only=True)
        assert len(_failure_lines(caplog)) == 2  # not due yet
        clock.now += 31
        failures.flush(due_only=True)  # the node's loop: due, though no failure came since
        lines = _failure_lines(caplog)
        assert _counted(lines, "KeyError: 'missing'") == 2 and _counted(lines, "TimeoutError: tool timed out") == 2
        failures.failed("a9", KeyError("missing"))
        failures.flush()
    lines = _failure_lines(caplog)
    assert _counted(lines, "KeyError: 'missing'") == 3 and lines[-1].getMessage().startswith(
        "node n0: 1 more episode failed in the last 0.0 s: KeyError: 'missing'")
    failures.flush()
    assert len(_failure_lines(caplog)) == len(lines)  # nothing left to say


def test_reasons_that_differ_per_task_are_counted_together_past_the_first_ones(caplog):
    clock = Clock()
    failures = FailureLog("n0", clock=clock, max_reasons=3)
    with caplog.at_level(logging.WARNING, logger="astraflow.rollout"):
        for i in range(50):
            failures.failed(f"t{i}", KeyError(f"task-{i}"))
        failures.flush()
    lines = _failure_lines(caplog)
    assert [r.exc_info is not None for r in lines] == [True, True, True, False]
    assert lines[-1].getMessage() == ("node n0: 47 more episodes failed in the last 0.0 s: "
                                      "KeyError (reasons past the first 3)")


def test_one_place_that_raises_with_a_message_per_task_is_one_reason(caplog):
    """An environment whose error names the task's value (a cell, an id) is one bug: one
    traceback, then counts, said by where it was raised."""
    failures = FailureLog("n0", clock=Clock())

    def step(cell):
        raise RuntimeError(f"stepped on trap {cell}")

    with caplog.at_level(logging.WARNING, logger="astraflow.rollout"):
        for i in range(20):
            try:
                step((i % 3, i % 5))
            except RuntimeError as err:
                failures.failed(f"t{i}", err)
                where = reason_of(err)[1]
        failures.flush()
    lines = _failure_lines(caplog)
    assert [r.exc_info is not None for r in lines] == [True, False]
    assert where.startswith("raised at ") and where.endswith(f"{__file__}:{step.__code__.co_firstlineno + 1}")
    assert lines[-1].getMessage().endswith(f"19 more episodes failed in the last 0.0 s: RuntimeError {where}")
