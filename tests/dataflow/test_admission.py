"""Admission by version: the rule on scripted versions and work ahead (lag, replay, filtered
groups, mixing, two policies, stopped trainers), and the data layer applying it."""

from __future__ import annotations

import asyncio

import pytest

from astraflow.dataflow.admission import PolicyClock, TrainerPace, admits
from tests.dataflow.helpers import make_trajectory, store_and_ref
from tests.dataflow.test_data_layer import make_layer


def clock(**kw) -> PolicyClock:
    base = dict(next_version=10, buffered={}, per_batch=128.0, per_group=8.0, oldest_node_version=10)
    return PolicyClock(**{**base, **kw})


@pytest.mark.parametrize("ahead_groups, lag, staleness, ok", [
    # batches of 16 groups; a new group is taken at next + floor(ahead / 16)
    (0, 0, 0, True),      # the next batch: on-policy
    (15, 0, 0, True),     # still the next batch
    (16, 0, 0, False),    # one batch later: 1 version stale, bound 0
    (16, 0, 1, True),
    (47, 0, 2, True),     # taken at next + 2
    (48, 0, 2, False),
    (16, 1, 2, True),     # node one version behind: taken at next + 1, tokens from next - 1
    (32, 1, 2, False),
    (0, 3, 2, False),     # a node three versions behind: nothing it generates can be trained on
])
def test_a_group_is_admitted_only_if_it_can_be_trained_on(ahead_groups, lag, staleness, ok):
    c = clock(oldest_node_version=10 - lag)
    # the groups ahead split between the buffer (sequences) and rollout (groups)
    buffered = ahead_groups // 2
    c.buffered = {"": buffered * 8}
    assert admits("", 1.0, ahead_groups - buffered, [c], staleness) is ok


def test_replay_and_filters_change_what_a_batch_takes():
    # a quarter of each batch replayed: 96 new sequences a batch, so 12 groups fill one
    assert admits("", 1.0, 11, [clock(per_batch=96.0)], 0)
    assert not admits("", 1.0, 12, [clock(per_batch=96.0)], 0)
    # half the groups dropped by the filter: a group in rollout brings 4 sequences on average
    assert admits("", 1.0, 31, [clock(per_group=4.0)], 0)
    assert not admits("", 1.0, 32, [clock(per_group=4.0)], 0)


def test_mixing_counts_each_source_against_its_share_of_a_batch():
    c = clock(buffered={"a": 96, "b": 0})  # 12 groups of source a buffered
    # a has 3/4 of each batch (12 groups): a 13th is one batch later; b's quarter is empty
    assert not admits("a", 0.75, 0, [c], 0)
    assert admits("b", 0.25, 3, [c], 0) and not admits("b", 0.25, 4, [c], 0)


def test_every_active_policy_must_be_able_to_train_on_it_a_stopped_one_does_not_count():
    solver, verifier = clock(), clock(next_version=3, oldest_node_version=3, buffered={"": 200})
    assert not admits("", 1.0, 0, [solver, verifier], 0)  # the verifier holds a full batch
    verifier.active = False
    assert admits("", 1.0, 0, [solver, verifier], 0)


def test_a_waiting_batch_takes_its_quota_and_the_rest_spills_later():
    # replay-heavy: 2 new sequences a batch planned, groups of 4
    c = clock(per_batch=2.0, per_group=4.0, policy="p")
    assert not admits("", 1.0, 0, [c], 0)  # the usual estimate: its last sequence one batch late
    # the replay buffer is short, so the waiting batch takes 8 new sequences: all of it at v10
    assert admits("", 1.0, 0, [c], 0, waiting={"p": 8})
    assert admits("", 1.0, 1, [c], 0, waiting={"p": 8})  # 4 ahead: still fits
    # 8 ahead: its 4 spill past the batch, 2 a batch, into v12
    assert not admits("", 1.0, 2, [c], 1, waiting={"p": 8}) and admits("", 1.0, 2, [c], 2, waiting={"p": 8})
    # nothing ahead: admitted even if its spill ages past the bound (the batch needs it)
    assert admits("", 1.0, 0, [c], 0, waiting={"p": 2})
    # nodes two versions behind: nothing they generate can be trained on, waiting or not
    lagging = clock(per_batch=2.0, per_group=4.0, policy="p", oldest_node_version=8)
    assert not admits("", 1.0, 0, [lagging], 1, waiting={"p": 8})
    # only the waiting policies are asked: another whose buffer is full does not block it
    full = clock(policy="q", buffered={"": 640})
    assert admits("", 1.0, 0, [c, full], 0, waiting={"p": 8}) and not admits("", 1.0, 0, [c, full], 0)


def test_a_trainer_is_active_while_it_asks_at_its_pace():
    pace = TrainerPace(stall_floor_s=30.0)
    assert not pace.active(0.0)  # still loading: holds no one back
    pace.asked(0.0)
    pace.waiting = 1
    assert pace.active(1000.0)  # waiting for a batch
    pace.waiting = 0
    for t in (10.0, 20.0, 30.0):
        pace.asked(t)
    assert pace.active(30.0 + 35.0)  # 4 x its 10 s pace: still training
    assert not pace.active(30.0 + 45.0)  # silent for longer: stopped


def test_a_node_behind_the_trainer_gets_no_new_group_and_no_long_wait(tmp_path):
    layer = make_layer(tmp_path, batch_size=8, max_staleness=0, prefetch_groups=4)

    async def go():
        await layer.published("p", 3, {})
        asked = asyncio.create_task(layer.next_batch("p", 3, timeout=30))
        await asyncio.sleep(0)  # the trainer waits for its batch: its groups may always start
        first = await layer.lease("n0", 100, versions={"p": 3})
        assert len(first) == 8  # the batch it waits for, nothing beyond (staleness 0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await layer.lease("lagging", 100, 5.0, versions={"p": 2}) == []
        assert loop.time() - t0 < 1.0  # no long poll: it comes back with newer weights
        w = layer.store.writer("n0")
        await layer.complete(store_and_ref(w, [make_trajectory(t, float(i % 2), version=3) for i, t in enumerate(first)]))
        assert len(await asyncio.wait_for(asked, 10)) == 8
        assert layer.counts["p"]["admission_refused"] > 0

    asyncio.run(go())


def test_prefetch_admission_keeps_the_groups_ahead_bound_only(tmp_path):
    layer = make_layer(tmp_path, batch_size=8, max_staleness=0, prefetch_groups=4, admission="prefetch")

    async def go():
        await layer.published("p", 3, {})
        tasks = await layer.lease("lagging", 100, versions={"p": 0})
        assert len(tasks) == 8 + 4 * 4  # one batch and 4 groups ahead, however old the node is

    asyncio.run(go())


async def _node_until(layer, stop: asyncio.Event, name: str = "n0", capacity: int = 8) -> None:
    """A node that leases with the trainer's versions, completes at once, until ``stop``."""
    writer = layer.store.writer(name)
    while not stop.is_set():
        versions = dict(layer.versions)
        tasks = await layer.lease(name, capacity, wait=0.05, versions=versions)
        if tasks:
            trajs = [make_trajectory(t, float(int(t.task_id.split("/")[1]) % 2), version=versions["p"], node=name)
                     for t in tasks]
            await layer.complete(store_and_ref(writer, trajs))
        await asyncio.sleep(0.001)


def test_the_buffer_cap_follows_the_limit_as_nodes_join(tmp_path):
    """With ``prefetch_covers_nodes`` the groups allowed ahead grow with the nodes' slots; the
    cap on what a policy buffers before its trainer asks grows with them: nothing generated
    within the limit is dropped as overflow (and generated again)."""
    layer = make_layer(tmp_path, admission="prefetch", prefetch_covers_nodes=True)
    cap_before = layer.buffers.cap_groups

    async def nodes_only():
        stop = asyncio.Event()
        running = [asyncio.create_task(_node_until(layer, stop, f"n{i}", capacity=64)) for i in range(2)]
        await asyncio.sleep(1.5)  # the trainer has not asked yet
        stop.set()
        await asyncio.gather(*running)

    asyncio.run(nodes_only())
    assert layer.buffers.cap_groups > cap_before and layer.buffers.cap_groups == 4 * layer.limit
    assert layer.buffers.counts["p"]["overflow_dropped"] == 0
    assert layer.buffers.group_seq <= layer.limit


async def _train(layer, steps: int, policies=("p",), timeout: float = 10.0) -> dict[str, int]:
    """Nodes lease with the trainers' versions and complete at once while each policy's trainer
    takes ``steps`` batches and publishes after each; returns the sequences each took."""
    stop = asyncio.Event()
    node = asyncio.create_task(_node_until(layer, stop))
    taken = {p: 0 for p in policies}

    async def trainer(p: str) -> None:
        for v in range(steps):
            taken[p] += len(await layer.next_batch(p, v, timeout=timeout))
            await layer.published(p, v + 1, {})

    try:
        await asyncio.gather(*(trainer(p) for p in policies))
    finally:
        stop.set()
        await node
    return taken


def test_a_source_smaller_than_a_group_per_batch_is_still_admitted(tmp_path):
    """A 9:1 mixture with batches of two groups: the small source's share of a batch is a
    fraction of a group, so its next group is always taken batches later. A batch that waits
    for it must still get it (the group spills into later batches, within the bound)."""
    from tests.dataflow.test_mix import make_layer as mix_layer, sources
    layer = mix_layer(tmp_path, params={"sources": sources(a=9, b=1)}, batch_size=8, max_staleness=1)
    assert asyncio.run(_train(layer, 12)) == {"p": 96}
    assert layer.mixer.consumed["p"]["b"] > 0


def test_replay_heavy_batches_still_form(tmp_path):
    """``replay_ratio: 0.9``: the first batch has nothing to replay and takes a whole batch of
    new groups, far more than a replay-sized share; so does a later one whose pool has aged
    past ``max_staleness`` (replays are all or none): admission plans with what the pool holds."""
    layer = make_layer(tmp_path, max_staleness=1, replay_ratio=0.9)
    assert asyncio.run(_train(layer, 4)) == {"p": 32}


def test_a_waiting_batch_of_groups_with_few_sequences_is_not_capped_away(tmp_path):
    """Groups that yield few sequences (most of their tasks fail): a batch needs more groups than
    the buffer cap counts. The trainer waits, so nothing it needs is dropped as overflow."""
    from tests.dataflow.test_data_layer import Node

    layer = make_layer(tmp_path, batch_size=16, group_size=16, prefetch_groups=0, max_attempts=1,
                       admission="prefetch")

    async def go():
        node = Node(layer)
        waiter = asyncio.ensure_future(layer.next_batch("p", 0, timeout=20))
        while not waiter.done():
            tasks = await layer.lease("n0", 16, wait=0.2)
            ok = [t for t in tasks if int(t.task_id.split("/")[1]) < 2]  # 2 of each 16 succeed
            for t in tasks:
                if t not in ok:
                    await layer.fail(t.task_id, "boom")
            if ok:
                trajs = [make_trajectory(t, float(int(t.task_id.split("/")[1])), node="n0") for t in ok]
                await layer.complete(store_and_ref(node.writer, trajs))
            await asyncio.sleep(0)
        assert len(await waiter) == 16

    asyncio.run(go())
    assert layer.buffers.counts["p"]["overflow_dropped"] == 0


def test_a_batch_the_rules_starve_names_them_in_its_timeout(tmp_path):
    """Every group solved and ``drop_zero_advantage``: no batch ever comes, and the trainer's
    timeout names the group filter (not only what is buffered and pending)."""
    from astraflow.dataflow.config import DropZeroAdvantageRule
    from astraflow.dataflow.layer import BatchTimeout

    layer = make_layer(tmp_path, group_filter=DropZeroAdvantageRule())
    writer = layer.store.writer("n0")

    async def go():
        for _ in range(3):
            tasks = await layer.lease("n0", 64)
            await layer.complete(store_and_ref(writer, [make_trajectory(t, 1.0) for t in tasks]))
        with pytest.raises(BatchTimeout, match=r"the group filter \(dataflow.group_filter: drop_zero_advantage\) "
                                               r"dropped (\d+) of \1 sequences: .*loosen them"):
            await layer.next_batch("p", 0, timeout=0.5)

    asyncio.run(go())
