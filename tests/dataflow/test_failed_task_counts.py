"""Failing episodes show while a run runs: every step line of ``metrics.jsonl`` carries the
rollout tasks that failed since the previous step line and the run's total."""

from __future__ import annotations

import asyncio
import json

from tests.dataflow.helpers import make_trajectory, store_and_ref
from tests.dataflow.test_data_layer import Node, make_layer


def _steps(tmp_path) -> list[dict]:
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "failed_tasks" in r or "consumed" in r]


def test_step_lines_carry_failed_tasks_since_the_last_line_and_the_total(tmp_path):
    layer = make_layer(tmp_path, max_attempts=1)
    node = Node(layer)

    async def fail(n: int):
        for t in await layer.lease("n", n):
            await layer.fail(t.task_id, "tool broke", attempt=t.attempt)

    async def step(version: int):
        while await layer.ready("p", version - 1) < 8:
            await node.roll(8, reward_of=lambda t: float(int(t.task_id.split("/")[1]) % 2))
        await layer.next_batch("p", version - 1, timeout=5)
        await layer.published("p", version, {"loss": 0.0})

    async def go():
        await fail(2)
        await step(1)
        await fail(3)
        await step(2)
        await step(3)

    asyncio.run(go())
    steps = _steps(tmp_path)
    assert [(r["step"], r["failed_tasks"], r["failed_tasks_total"]) for r in steps] == [(1, 2, 2), (2, 3, 5), (3, 0, 5)]


def test_a_step_record_without_failures_says_zero(tmp_path):
    layer = make_layer(tmp_path)

    async def go():
        tasks = await layer.lease("n", 8)
        writer = layer.store.writer("n")
        await layer.complete(store_and_ref(writer, [make_trajectory(t, float(i % 2)) for i, t in enumerate(tasks)]))
        await layer.next_batch("p", 0, timeout=5)
        await layer.published("p", 1, {"loss": 0.0})

    asyncio.run(go())
    assert (_steps(tmp_path)[-1]["failed_tasks"], _steps(tmp_path)[-1]["failed_tasks_total"]) == (0, 0)



def test_a_restored_layer_does_not_count_the_run_s_earlier_failures_again(tmp_path):
    """A data layer built on the saved state (a resume, a re-placement): its first step line
    counts only what failed since it started."""
    from astraflow.dataflow.config import DataflowConfig
    from astraflow.dataflow.layer import DataLayer
    from astraflow.workloads.config import EvalConfig, WorkloadConfig
    from tests.dataflow.test_data_layer import MATH

    def layer() -> DataLayer:
        return DataLayer(dataflow=DataflowConfig(batch_size=8, max_attempts=1),
                         workload=WorkloadConfig(name="math", params=MATH, group_size=4, eval=EvalConfig(every=0)),
                         policies=["p"], store_url=str(tmp_path / "t"), metrics_path=str(tmp_path / "metrics.jsonl"),
                         max_steps=5, snapshot_path=str(tmp_path / "snap"), journal_path=str(tmp_path / "ledger.jsonl"))

    first = layer()

    async def before():
        for t in await first.lease("n", 3):
            await first.fail(t.task_id, "tool broke", attempt=t.attempt)
        await first.close()

    asyncio.run(before())
    again = layer()
    assert again.ledger.events["failed"] == 3 and again._failed_recorded == 3


def test_failures_whose_messages_carry_their_input_are_counted_under_a_bounded_set_of_keys(tmp_path):
    """A reward whose error names its input fails each task with another message: the counters
    (in every status and summary) keep ``MAX_REASONS`` of them by name and the rest together,
    and the requeues are counted by kind."""
    from astraflow.dataflow.ledger import MAX_REASONS, OTHER_REASONS

    layer = make_layer(tmp_path, max_attempts=2)
    n = MAX_REASONS + 20

    async def go():  # two attempts each: the second ends the task as failed
        while layer.ledger.summary()["events"].get("failed", 0) < n:
            for t in await layer.lease("n", n - layer.ledger.summary()["events"].get("failed", 0)):
                await layer.fail(t.task_id, f"reward raised ValueError: bad answer {t.task_id}\nTraceback ...",
                                 attempt=t.attempt)

    asyncio.run(go())
    ledger = layer.ledger.summary()
    by_reason = ledger["failed_by_reason"]
    assert len(by_reason) == MAX_REASONS + 1 and sum(by_reason.values()) == n
    assert by_reason[OTHER_REASONS] == n - MAX_REASONS
    assert all("Traceback" not in why for why in by_reason)  # the first line names it
    assert ledger["events"]["requeued_failed"] == ledger["events"]["requeued"] >= n  # by kind
    assert not [k for k in ledger["events"] if k.startswith("requeued_failed:")]
    assert len(ledger["requeued_by_reason"]) == MAX_REASONS + 1  # why they were retried, bounded as well
