"""The end of a run (``DataLayer.finish``): a run that stopped before its end (a lost trainer, a
failure, Ctrl-C, a requeue) keeps the batches served and never committed, for the resume to put
back and train, instead of dropping them as ``served_not_trained``; a run that reached its end
still drops them."""

from __future__ import annotations

import uuid

import pytest

from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.layer import DataLayer
from astraflow.workloads.config import EvalConfig, WorkloadConfig
from tests.dataflow.test_data_layer import MATH, Node, run
from tests.dataflow.test_durable import Paths, _alternating, _ended_once


def _served_then_lost(layer: DataLayer):
    """16 sequences rolled, v1 committed, then the batch at v1 served to a trainer that is lost."""

    async def go():
        await Node(layer).roll(16, reward_of=_alternating)
        first = await layer.next_batch("p", 0, timeout=5)
        await layer.published("p", 1, {"loss": 0.0})
        lost = await layer.next_batch("p", 1, timeout=5)
        return first, lost

    return run(go())


@pytest.mark.parametrize("committed", [1, 2], ids=["lost-while-training", "lost-after-commit-before-report"])
def test_a_run_stopped_before_its_end_keeps_served_batches_and_the_resume_trains_them(tmp_path, committed):
    """``committed``: the newest version in the weight store when the run stopped (2: the lost
    trainer committed v2, trained on the kept batch, without reporting it)."""
    paths = Paths(tmp_path)
    old = paths.layer()
    first, lost = _served_then_lost(old)

    async def stop():
        summary = await old.finish(completed=False)
        await old.close()
        return summary

    summary = run(stop())
    assert "served_not_trained" not in summary["dropped_by_reason"]
    assert summary["open"] == summary["kept_for_resume"] == 8  # the lost batch's tasks, kept open
    assert "served_not_trained" not in paths.journal.read_text()

    resumed = paths.layer()  # `astraflow run` again on the run directory

    async def resume():
        out = await resumed.trainer_restarted("p", committed, restart=False)
        if committed == 1:  # put back, served again and trained
            assert out == {"put_back": 8, "recovered": []}
            again = await resumed.next_batch("p", 1, timeout=5)
            assert sorted(i.task_id for i in again.items) == sorted(i.task_id for i in lost.items)
            await resumed.published("p", 2, {"loss": 0.0})
        else:  # trained on by the commit the lost trainer never reported: consumed now
            assert out == {"put_back": 0, "recovered": [2]}
        end = await resumed.finish()
        await resumed.close()
        return end

    end = run(resume())
    assert end["open"] == 0 and "served_not_trained" not in end["dropped_by_reason"]
    outcomes = _ended_once(paths.journal_lines())  # every task created ended exactly once, across both runs
    assert outcomes["consumed"] == 16
    consumed = {x["t"] for x in paths.journal_lines() if x["e"] == "consumed"}
    assert consumed == {i.task_id for i in first.items} | {i.task_id for i in lost.items}
    assert paths.steps() == [1, 2]


def test_a_run_that_reached_its_end_still_drops_served_uncommitted_batches(tmp_path):
    paths = Paths(tmp_path)
    layer = paths.layer()
    _, lost = _served_then_lost(layer)

    async def stop():
        summary = await layer.finish()  # completed: no resume follows
        await layer.close()
        return summary

    summary = run(stop())
    assert summary["open"] == 0 and summary["dropped_by_reason"]["served_not_trained"] == 8
    assert "kept_for_resume" not in summary
    ends = {x["t"]: x.get("r") for x in paths.journal_lines() if x["e"] != "created"}
    assert {ends[i.task_id] for i in lost.items} == {"served_not_trained"}


def test_without_durable_state_nothing_can_be_put_back_so_nothing_is_kept(tmp_path):
    layer = DataLayer(
        dataflow=DataflowConfig(batch_size=8, durable=False),
        workload=WorkloadConfig(name="math", params=MATH, group_size=4, eval=EvalConfig(every=0, num_prompts=3)),
        policies=["p"], store_url=f"memory://{uuid.uuid4().hex}", metrics_path=str(tmp_path / "metrics.jsonl"),
        max_steps=5,
    )
    _served_then_lost(layer)
    summary = run(layer.finish(completed=False))
    assert summary["open"] == 0 and summary["dropped_by_reason"]["served_not_trained"] == 8



def test_a_stopped_run_rolls_out_first_the_prompts_of_the_groups_it_cut_short(tmp_path):
    """Groups still in rollout when a run stops end as ``run_ended``; the resume takes their
    prompts again first, instead of going on after them (they would wait for the next epoch)."""
    paths = Paths(tmp_path)
    old = paths.layer()

    async def stop():
        await Node(old).roll(6)  # one group completes, the next is half done, the rest not leased
        cut = [(g.prompt_key, g.kind) for g in old.buffers.rolling.values()]
        await old.finish(completed=False)
        await old.close()
        return [key for key, kind in cut if kind == "train"]

    cut = run(stop())
    assert len(cut) >= 2
    resumed = paths.layer()

    async def resume():
        await resumed.lease("n1", 1)  # the resumed layer opens its first groups
        opened = [g.prompt_key for g in resumed.buffers.rolling.values()]
        await resumed.finish()
        await resumed.close()
        return opened

    opened = run(resume())
    assert opened[:len(cut)] == cut


def test_groups_buffered_at_a_stop_are_trained_after_the_resume(tmp_path):
    """Groups whose rollout ended but that no batch took yet stay in the buffer for the resume
    (their tasks open), instead of ending as ``run_ended`` with their prompts skipped for the epoch."""
    paths = Paths(tmp_path)
    old = paths.layer()

    async def stop():
        await Node(old).roll(10)  # two groups complete and buffered (a batch is 8 of 16), one half done
        buffered = {it.task_id for grp in old.buffers.ready["p"] for it in grp.items}
        summary = await old.finish(completed=False)
        await old.close()
        return buffered, summary

    buffered, summary = run(stop())
    assert len(buffered) == 8 and summary["kept_for_resume"] == 8
    ended = {x["t"] for x in paths.journal_lines() if x["e"] == "dropped"}
    assert ended and not buffered & ended  # the cut-short group's tasks ended; the buffered ones are open
    resumed = paths.layer()

    async def resume():
        batch = await resumed.next_batch("p", 0, timeout=5)
        taken = {i.task_id for i in batch.items}
        await resumed.finish()
        await resumed.close()
        return taken

    assert run(resume()) == buffered  # the resume's first batch is what the stop left buffered
    assert _ended_once(paths.journal_lines())["consumed"] == 0  # served, never committed: the end drops them


def test_a_resume_whose_workload_has_fewer_prompts_starts_its_orders_afresh(tmp_path):
    """The saved prompt order names prompts of the old workload's train split; a resumed config
    with fewer of them must not lease from indices past its end."""
    from astraflow.dataflow.config import DataflowConfig

    paths = Paths(tmp_path)
    old = paths.layer()

    async def stop():
        await Node(old).roll(6)
        await old.finish(completed=False)
        await old.close()

    run(stop())
    resumed = DataLayer(
        dataflow=DataflowConfig(batch_size=8),
        workload=WorkloadConfig(name="math", params={**MATH, "num_train": 10}, group_size=4,
                                eval=EvalConfig(every=0, num_prompts=3)),
        policies=["p"], store_url=paths.url, metrics_path=str(paths.metrics), max_steps=5,
        state_path=str(paths.state), snapshot_path=str(paths.snapshot), journal_path=str(paths.journal))

    async def lease():
        tasks = await resumed.lease("n1", 4)
        await resumed.finish()
        await resumed.close()
        return tasks

    assert len(run(lease())) == 4
    assert all(0 <= i < 10 for i in resumed.mixer.order[""])
