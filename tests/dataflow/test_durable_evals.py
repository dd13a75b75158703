"""Evaluation rounds across a replaced data layer and a resumed run: started once, timed by run
time, under new ids when the config changed, at the version the trainers resume from."""

from __future__ import annotations

import time

from astraflow.dataflow import durable
from tests.dataflow.test_data_layer import Node, run
from tests.dataflow.test_durable import Paths, _alternating, _ended_once


def test_a_resumed_evaluation_round_is_not_started_twice(tmp_path):
    paths = Paths(tmp_path)
    old = paths.layer(eval_every=2)
    eval_tasks = len(old.leases.eval_pending)
    run(old.close())
    layer = paths.layer(eval_every=2)
    assert len(layer.leases.eval_pending) == eval_tasks and list(layer.evals.rounds) == [0]


def test_a_replaced_layer_keeps_when_an_evaluation_round_was_first_leased(tmp_path):
    """A round's ``eval_seconds`` counts from its first lease: a layer built on the change log
    of a lost one knows that time, also when nothing of the round but the lease was recorded
    since (no answer of it came in yet)."""
    paths = Paths(tmp_path)
    lost = paths.layer(eval_every=2)

    async def lease_round_0():
        await lost.start_eval(2)  # a record holding both rounds, neither leased yet
        return await lost.lease("n0", 2)  # round 0's tasks come first

    held = run(lease_round_0())
    assert [t.min_version for t in held] == [0, 0] and lost.evals.rounds[0].leased_at is not None
    layer = paths.layer(keep_leases=True, eval_every=2)
    assert layer.evals.rounds[0].leased_at == lost.evals.rounds[0].leased_at
    assert layer.evals.rounds[2].leased_at is None


def test_an_evaluation_cut_short_by_the_runs_end_does_not_hold_back_the_resumed_run(tmp_path, monkeypatch):
    """The run ends (Ctrl-C) while a held-out round is open: its tasks are dropped, so the round is
    forgotten, not restored; the resumed run evaluates that version again under fresh task ids and
    finishes. A snapshot that still holds such a round (its tasks gone) is cleaned up on restore,
    and the finished rounds it held back are written."""
    paths = Paths(tmp_path)
    old = paths.layer(eval_every=2)

    async def one_eval_task(layer):
        await Node(layer, "n-old").roll(1)  # evaluation tasks are leased first: one of round 0

    run(one_eval_task(old))
    assert old.evals.rounds[0].remaining == 2
    run(old.finish())
    assert 0 not in old.evals.rounds  # cut short: not recorded, not kept
    run(old.close())

    resumed = paths.layer(eval_every=2)
    tasks = [resumed.leases.tasks[t] for t in resumed.leases.eval_pending]
    assert list(resumed.evals.rounds) == [0] and len(tasks) == 3
    assert {t.group_id.rpartition("-")[0] for t in tasks} == {"eval-v0.1"}  # the old ids ended: fresh ones

    async def finish_round(layer):
        await Node(layer, "n-new").roll(3)
        return await layer.eval_done(0)

    assert run(finish_round(resumed))
    assert paths.steps().count(0) == 1  # one record of v0: the resumed round's
    run(resumed.close())

    # a snapshot of a data layer that kept the open round (its tasks ended) is cleaned up on restore
    paths2 = Paths(tmp_path / "second")
    (tmp_path / "second").mkdir()
    older = paths2.layer(eval_every=2)
    run(one_eval_task(older))
    monkeypatch.setattr(type(older.evals), "drop_unfinishable", lambda self, alive=None: [])
    run(older.finish())
    monkeypatch.undo()
    assert older.evals.rounds[0].result is None and not older.leases.eval_pending
    run(older.close())
    restored = paths2.layer(eval_every=2)

    async def evaluate_v2(layer):
        await layer.start_eval(2)
        await Node(layer, "n-new").roll(6)  # the fresh round at v0 and the round at v2
        return await layer.eval_done(2)

    assert run(evaluate_v2(restored))  # not held back behind the old round
    assert sorted(paths2.steps()) == [0, 2]
    run(restored.close())


def test_a_changed_config_starts_an_evaluation_round_under_new_ids(tmp_path):
    """The saved round's tasks end as config_changed; the new round of the same version takes
    ids of its own: every task in the journal is created and ended once."""
    paths = Paths(tmp_path)
    old = paths.layer(eval_every=2)
    run(old.lease("n0", 2))
    run(old.close())
    new = paths.layer(eval_every=2, group_size=2)
    assert new.leases.eval_pending and all(".1-" in t for t in new.leases.eval_pending)
    run(new.finish())
    run(new.close())
    _ended_once(paths.journal_lines())


def test_a_resumed_runs_first_evaluation_is_at_the_version_its_trainers_resume_from(tmp_path):
    """The change log ends behind the weight store (a power loss): the resume's evaluation round
    starts only once the trainers' versions have moved forward, at those versions."""
    paths = Paths(tmp_path)
    layer = paths.layer(eval_every=2, max_steps=50)
    run(Node(layer).roll(8, reward_of=_alternating))
    run(layer.close())
    state = durable.load(paths.snapshot)
    assert state is not None
    again = paths.layer(eval_every=2, max_steps=50)
    again.versions["p"] = 3  # what the change log recorded (set as if restored behind the store)
    again._eval_at_start = True

    async def resume():
        await again.trainer_restarted("p", 9, restart=False)  # the store's newest committed version
        await again.resume_evaluation()
        await again.resume_evaluation()  # once only
        await again.close()

    run(resume())
    assert max(again.evals.rounds) == 9


def test_a_resumed_round_does_not_count_the_time_between_the_runs(tmp_path):
    """An open round's ``eval_seconds`` counts its first lease onwards in run time: a resumed run
    goes on from where the round stood when the last run saved, as its own clock does."""
    paths = Paths(tmp_path)
    first = paths.layer(eval_every=2)

    async def lease_round_0():
        await first.lease("n0", 1)
        await first.close()

    run(lease_round_0())
    before = first.evals.rounds[0]
    ran_for = time.time() - before.leased_at
    time.sleep(1.5)
    resumed = paths.layer(eval_every=2)
    rnd = resumed.evals.rounds[0]
    assert rnd.result is None and rnd.leased_at is not None
    assert time.time() - rnd.leased_at < ran_for + 1.0
    assert rnd.leased_at - rnd.started == before.leased_at - before.started
    run(resumed.close())


def test_a_resumed_runs_first_evaluation_holds_training_until_it_is_done(tmp_path):
    """As the run's first round does: the resume's round measures exactly the weights training
    goes on from, so no batch is served (no newer version made) before its answers are in."""
    paths = Paths(tmp_path)
    layer = paths.layer(eval_every=2, max_steps=50)
    run(Node(layer).roll(8, reward_of=_alternating))
    run(layer.close())
    again = paths.layer(eval_every=2, max_steps=50)
    again._eval_at_start = True

    async def resume():
        await again.trainer_restarted("p", 9, restart=False)
        await again.resume_evaluation()

    run(resume())
    assert again.evals.rounds[9].remaining > 0 and not again.evals.initial_done()
    tasks = len(again.leases.eval_pending)
    run(Node(again, "n-new").roll(tasks))  # evaluation tasks are leased first: the round's answers
    assert 9 not in again.evals.rounds or again.evals.rounds[9].remaining <= 0
    assert again.evals.initial_done()
    run(again.close())
