"""Evaluation rounds on their own: their tasks, accuracy records, failures, the records'
version order and the first round gating training."""

from __future__ import annotations

import pytest

from astraflow.contracts import TrajectoryRef
from astraflow.dataflow.evals import EvalRounds

PAYLOADS = [{"q": i} for i in range(3)]


def rounds(k=1, sources=("", "", ""), by_source=False):
    written: list[dict] = []
    ev = EvalRounds(PAYLOADS, list(sources), k=k, policies=["p", "q"], workflow="w", by_source=by_source,
                    started=0.0, write=written.append)
    return ev, written


def finish(ev, tasks, score=1.0):
    for t in tasks:
        ev.record(t, TrajectoryRef(t.task_id, t.group_id, "eval", 0, "n", (), score=score))


def test_a_round_is_k_tasks_per_prompt_and_starts_once():
    ev, _ = rounds(k=2)
    tasks = ev.start(4)
    assert [t.task_id for t in tasks] == [f"eval-v4-{i}/{j}" for i in range(3) for j in range(2)]
    assert all(t.kind == "eval" and t.min_version == 4 and t.sampling is None for t in tasks)
    assert ev.start(4) == [] and rounds()[0].start(0)[0].sampling == {"greedy": True}


def test_records_accuracy_and_writes_in_version_order():
    ev, written = rounds()
    t0, t2 = ev.start(0), ev.start(2)
    assert not ev.initial_done()
    finish(ev, t2, 1.0)
    assert written == [] and not ev.done(2)  # waits for v0
    finish(ev, t0[:2], 0.0)
    ev.failed(t0[2])  # a failed task: the round finishes without it
    assert ev.initial_done() and [(r["step"], r["eval_accuracy"]) for r in written] == [(0, 0.0), (2, 1.0)]
    assert written[0]["eval_prompts"] == 2 and ev.done(2) and ev.results == written
    assert written[0]["eval_failed_tasks"] == 1 and written[1]["eval_failed_tasks"] == 0


def test_a_round_whose_every_task_failed_has_no_accuracy_and_readers_skip_it():
    from astraflow.runtime.monitoring.text import eval_lines

    ev, written = rounds()
    for t in ev.start(0):
        ev.failed(t)
    finish(ev, ev.start(2), 1.0)
    assert "eval_accuracy" not in written[0] and written[0]["eval_prompts"] == 0
    assert eval_lines(written) == ["held-out accuracy: v2=1.000"]


def test_an_unfinished_round_is_passed_at_the_end_and_accuracy_by_source():
    ev, written = rounds(sources=("a", "b", "a"), by_source=True)
    ev.start(0)
    t1 = ev.start(1)
    finish(ev, t1[:2], 1.0)
    finish(ev, t1[2:], 0.0)
    ev.write(past_unfinished=True)
    (rec,) = written
    assert rec["step"] == 1 and rec["eval_accuracy_by_source"] == {"a": pytest.approx(0.5), "b": 1.0}


def test_without_held_out_prompts_a_round_is_over_at_once_with_no_record():
    """An empty test split (``num_test: 0``): nothing to evaluate, so a round neither holds back
    training nor the run's end (which waits for the last round), and no accuracy is made up."""
    written: list[dict] = []
    ev = EvalRounds([], [], k=1, policies=["p"], workflow="w", by_source=False, started=0.0, write=written.append)
    assert ev.start(0) == [] and ev.start(5) == []
    assert ev.initial_done() and ev.done(0) and ev.done(5) and written == [] and ev.results == []
    restored = EvalRounds([], [], k=1, policies=["p"], workflow="w", by_source=False, started=0.0, write=print)
    restored.rounds, restored.results = {}, []  # a re-placed data layer's: nothing saved of those rounds
    assert restored.done(5)  # the run's end does not wait for a round that never had a prompt
    only_sets = [{"q": 0, "eval_set": "extra"}]  # prompts of a second set only: evaluated at the first round
    ev, written = EvalRounds(only_sets, [""], k=1, policies=["p"], workflow="w", by_source=False, started=0.0,
                             write=[].append), None
    assert len(ev.start(0)) == 1 and ev.start(2) == [] and ev.done(2)


def test_a_record_names_the_newest_weights_that_answered_for_each_policy():
    """An answer begun on v4 and finished on v5 (an episode's later turns, a swap mid-decode) was
    answered by v5 too; a second policy's weights are recorded beside the first's."""
    import numpy as np

    from astraflow.contracts import NOT_GENERATED, Provenance, Sequence, Trajectory
    from storage.trajectories import EntryRef

    def answer(task, versions, policy_index=0):
        n = len(versions)
        seq = Sequence.build(tokens=np.arange(n + 2), loss_mask=[0, 0] + [1] * n, logprobs=[0.0] * (n + 2),
                             policy_ids=[NOT_GENERATED] * 2 + [policy_index] * n,
                             versions=[NOT_GENERATED] * 2 + versions, reward=1.0)
        traj = Trajectory(task.task_id, task.group_id, task.policies, task.workflow, task.kind, task.attempt,
                          (seq,), Provenance(node="n"))
        return TrajectoryRef.of(traj, [EntryRef("seg", 0)])

    ev, written = rounds()
    tasks = ev.start(4)
    ev.record(tasks[0], answer(tasks[0], [4, 4, 5, 5]))
    ev.record(tasks[1], answer(tasks[1], [4, 4]))
    ev.record(tasks[2], answer(tasks[2], [6, 6], policy_index=1))
    (record,) = written
    assert (record["eval_version_min"], record["eval_version_max"]) == (4, 5)
    assert record["eval_versions"] == {"p": [4, 5], "q": [6, 6]}
    trained = Trajectory("t", "g", ("p",), "w", "train", 0, (Sequence.build(
        tokens=np.arange(3), loss_mask=[0, 1, 1], logprobs=[0.0] * 3, policy_ids=[NOT_GENERATED, 0, 0],
        versions=[NOT_GENERATED, 1, 2], reward=0.0),), Provenance(node="n"))
    assert TrajectoryRef.of(trained, [EntryRef("seg", 0)]).newest is None  # training refs carry nothing more


def test_a_rounds_seconds_count_from_its_first_lease(monkeypatch):
    """The first round is made when the data layer starts and waits for the nodes to load their
    models: its ``eval_seconds`` is the evaluation's own time, from the first task a node leased."""
    import astraflow.dataflow.evals as evals_module

    clock = [100.0]
    monkeypatch.setattr(evals_module.time, "time", lambda: clock[0])
    ev, written = rounds()
    tasks = ev.start(0)
    clock[0] = 130.0  # the nodes start
    ev.leased(tasks[0])
    clock[0] = 131.0
    ev.leased(tasks[1])  # a later lease does not move the start
    clock[0] = 132.5
    finish(ev, tasks)
    assert written[0]["eval_seconds"] == pytest.approx(2.5)
    never = ev.start(2)  # a round none of whose tasks was leased (restored, say): from its making
    ev.rounds[2].started = 135.0
    clock[0] = 140.0
    finish(ev, never)
    assert written[1]["eval_seconds"] == pytest.approx(5.0)
