"""A run whose tasks complete but are all dropped untrained (every group filtered for equal
rewards, too few episodes of each group completing) stops naming the drop reasons and the
fix (``stopping.NothingCompletes``), as one whose tasks all fail does."""

from __future__ import annotations

import asyncio

from astraflow.dataflow.config import DropZeroAdvantageRule
from astraflow.runtime.stopping import NothingCompletes
from tests.dataflow.test_data_layer import Node, make_layer


def summary(completed: int, dropped: int, consumed: int, reasons: dict[str, int], failed: int = 0,
            kept: int = 0) -> dict:
    return {"events": {"completed": completed, "dropped": dropped, "consumed": consumed, "failed": failed,
                       "kept": kept},
            "dropped_by_reason": reasons, "failed_by_reason": {"failed:EpisodeError: boom": failed} if failed else {}}


def test_every_group_filtered_stops_the_run_naming_the_reason_and_the_fix():
    watch = NothingCompletes(limit=100)
    assert watch.check(summary(0, 0, 0, {})) is None  # the first tick is the baseline
    assert watch.check(summary(399, 399, 0, {"zero_advantage": 399})) is None
    why = watch.check(summary(400, 400, 0, {"zero_advantage": 400}))
    assert why.startswith("400 rollout tasks completed and were dropped untrained and none was trained on "
                          "(400x dropped: zero_advantage)"), why
    assert "same reward" in why and "episode viewer" in why


def test_drops_since_the_last_trained_batch_count_with_the_failures_meanwhile():
    watch = NothingCompletes(limit=100, dropped_limit=50)
    watch.check(summary(100, 20, 80, {"zero_advantage": 20}))
    assert watch.check(summary(150, 60, 90, {"zero_advantage": 60})) is None  # a batch trained: counting restarts
    why = watch.check(summary(200, 110, 90, {"zero_advantage": 60, "group_incomplete": 50}, failed=30))
    assert why.startswith("50 rollout tasks completed and were dropped untrained, 30 failed since the last one "
                          "was trained on (50x dropped: group_incomplete; 30x failed:EpisodeError: boom)"), why
    assert "too few episodes of each group completed" in why and "same reward" not in why


def test_filtered_groups_among_trained_batches_do_not_stop_the_run():
    watch = NothingCompletes(limit=100)
    for tick in range(1, 50):  # most groups filtered, yet a batch trains every tick
        assert watch.check(summary(400 * tick, 360 * tick, 40 * tick, {"zero_advantage": 360 * tick})) is None


def test_a_data_layer_whose_groups_all_score_alike_is_stopped(tmp_path):
    """The ledger of a real data layer whose every group gets equal rewards (``drop_zero_advantage``)."""
    layer = make_layer(tmp_path, group_size=4, batch_size=8, group_filter=DropZeroAdvantageRule())
    watch = NothingCompletes(limit=8)  # 32 dropped tasks stop it

    async def go():
        node = Node(layer)
        seen = [watch.check(layer.ledger.summary())]
        for _ in range(10):
            await node.roll(4, reward_of=lambda t: 0.0)
            seen.append(watch.check(layer.ledger.summary()))
        return seen

    seen = asyncio.run(go())
    assert seen[:8] == [None] * 8 and seen[8] is not None, seen
    assert seen[8].startswith("32 rollout tasks completed and were dropped untrained and none was trained on "
                              "(32x dropped: zero_advantage)")


def test_a_run_that_keeps_a_few_groups_is_slow_not_stuck():
    """Sparse signal: 95 % of the groups scored alike and dropped, a batch of 64 trained every
    1,280 completed tasks. Each kept group shows the run has signal: it is never stopped,
    however long a batch takes to fill (the limit is the orchestrator's: 4 x 256)."""
    watch = NothingCompletes(limit=256)
    completed = dropped = consumed = kept = 0
    for tick in range(400):
        completed += 32
        dropped += 30 if tick % 8 else 32  # a tick in eight keeps none
        kept += 0 if tick % 8 == 0 else 1
        if tick % 40 == 39:
            consumed += 64
        assert watch.check(summary(completed, dropped, consumed, {"zero_advantage": dropped}, kept=kept)) is None


def test_episodes_waiting_for_their_group_are_not_a_kept_group():
    """Tasks completed whose groups are not whole yet come and go between checks; only a kept
    group restarts the count, so a run that keeps none still stops."""
    watch = NothingCompletes(limit=256)
    completed = dropped = 0
    stopped = None
    for tick in range(200):
        waiting = (0, 4, 8)[tick % 3]
        dropped += 32
        completed = dropped + waiting
        stopped = stopped or watch.check(summary(completed, dropped, 0, {"zero_advantage": dropped}))
    assert stopped and "dropped untrained and none was trained on" in stopped


def test_a_run_deadline_names_a_curator_that_skipped_what_could_have_been_trained():
    """``run.timeout_s`` shorter than ``trainer.batch_timeout_s``: the deadline's line gives the
    reason a trainer's batch timeout would have (the curator skipped every prompt)."""
    from astraflow.config import load_config
    from astraflow.runtime.stopping import deadline_reason

    cfg = load_config("examples/tiny/config.yaml", ["run.timeout_s=150", "dataflow.curator.type=filter_solved"])
    status = {"counts": {"solver": {"curator_skipped": 40, "sequences_ingested": 0}},
              "sources": {"": {"groups_created": 3}}}
    why = deadline_reason(cfg, status)
    assert why.startswith("run deadline of 150s passed (run.timeout_s); the curator (dataflow.curator: filter_solved) "
                          "skipped 40 prompts against 3 groups made"), why
    assert deadline_reason(cfg, None) == "run deadline of 150s passed (run.timeout_s)"
    busy = {"counts": {"solver": {"curator_skipped": 2, "sequences_ingested": 64}},
            "sources": {"": {"groups_created": 9}}}
    assert deadline_reason(cfg, busy) == "run deadline of 150s passed (run.timeout_s)"


def _two_policy_trajectory(task, reward: float):
    """An episode in which policy ``a`` (index 0) and then ``b`` (index 1) each wrote one sequence."""
    from dataclasses import replace

    from tests.dataflow.helpers import make_trajectory

    first, second = make_trajectory(task, reward), make_trajectory(task, reward, policy_index=1)
    return replace(first, sequences=first.sequences + second.sequences)


def test_a_policy_whose_every_group_is_filtered_stops_the_run_while_another_trains(tmp_path):
    """Every task is consumed by ``a`` (so the ledger sees training and kept groups), while the
    group filter drops all of ``b``'s: the watch names ``b``, the rule and the count, and leaves
    a policy whose trainer took its last step alone."""
    from tests.dataflow.helpers import store_and_ref

    layer = make_layer(tmp_path, policies=("a", "b"), group_size=4, batch_size=8, admission="prefetch",
                       max_staleness=10, group_filter={"type": "tests.dataflow.user_rules:DropSecondPolicy"})
    watch = NothingCompletes(limit=8, max_steps=5, group_filter="tests.dataflow.user_rules:DropSecondPolicy")
    ledger_only = NothingCompletes(limit=8)

    async def go():
        writer = layer.store.writer("n0")
        seen = []
        for step in range(6):
            tasks = await layer.lease("n0", 8)
            rewards = [float(i % 2) for i in range(len(tasks))]
            await layer.complete(store_and_ref(writer, [_two_policy_trajectory(t, r) for t, r in zip(tasks, rewards)]))
            await layer.next_batch("a", step, timeout=5)
            await layer.published("a", step + 1, {"loss": 0.0})
            status = await layer.state(0)
            assert ledger_only.check(status["ledger"]) is None  # the ledger alone sees a healthy run
            seen.append(watch.check_layer(status))
        return seen

    seen = asyncio.run(go())
    assert seen[:2] == [None] * 2 and seen[2] is not None, seen  # the first tick is the baseline
    assert seen[2] == ("policy b is starved: 32 rollout sequences were routed to the policies and it kept none: "
                       "16 were for it and dropped untrained (16 by the group filter (dataflow.group_filter: "
                       "tests.dataflow.user_rules:DropSecondPolicy)); its trainer waits at v0: fix what drops them "
                       "or gives it none, then run again on this run directory"), seen[2]
    done = NothingCompletes(limit=8, max_steps=0)  # every trainer took its steps: nothing is starved
    assert all(done.check_layer({"versions": {"a": 0, "b": 0}, "counts": {"b": {"sequences_ingested": n}}}) is None
               for n in (0, 100, 1000))


def test_a_policy_its_episodes_give_no_tokens_is_starved_while_another_trains():
    """A workflow that writes the second policy's turn only sometimes (never, for a model that is
    never right): nothing is routed to it, nothing dropped for it; the others' sequences count."""
    watch = NothingCompletes(limit=8, max_steps=5)
    seen = []
    for tick in range(4):
        counts = {"a": {"sequences_ingested": 16 * tick, "accepted": 16 * tick, "consumed": 16 * tick}, "b": {}}
        seen.append(watch.check_layer({"versions": {"a": tick, "b": 0}, "counts": counts}))
    assert seen[:2] == [None, None] and seen[2].startswith(
        "policy b is starved: 32 rollout sequences were routed to the policies and it kept none: none was for it "
        "(its episodes wrote no tokens of it: see the workflow); its trainer waits at v0"), seen


def test_a_policy_that_keeps_some_groups_is_not_starved():
    watch = NothingCompletes(limit=8)
    for tick in range(50):  # b keeps one group in ten: slow, not stuck
        counts = {"b": {"sequences_ingested": 40 * tick, "filtered": 36 * tick, "accepted": 4 * tick}}
        assert watch.check_layer({"versions": {"b": 0}, "counts": counts}) is None


def test_a_curator_that_accepts_no_prompt_stops_the_run_naming_it(tmp_path):
    """No group is made, so nothing fails or is dropped: the curator's skips since the last
    group made stop the run (a trainer would otherwise wait out its batch timeout)."""
    layer = make_layer(tmp_path, group_size=4, batch_size=8,
                       curator={"type": "tests.dataflow.user_rules:reject_all_test"})
    watch = NothingCompletes(limit=8, curator="tests.dataflow.user_rules:reject_all_test")

    async def go():
        seen = []
        for _ in range(4):
            assert await layer.lease("n0", 8) == []  # each lease call proposes the train split once
            seen.append(watch.check_layer(await layer.state(0)))
        return seen

    seen = asyncio.run(go())
    assert seen[0] is None and any(seen), seen
    why = next(w for w in seen if w)
    assert why.startswith("the curator (dataflow.curator: tests.dataflow.user_rules:reject_all_test) skipped ")
    assert "accepted none since the last group was made (0 in all): loosen it" in why
    made = NothingCompletes(limit=8)  # a group made now and then: a selective curator, not a stuck one
    for tick in range(40):
        status = {"counts": {"p": {"curator_skipped": 20 * tick}}, "sources": {"": {"groups_created": tick}}}
        assert made.check_layer(status) is None
