"""A node with free slots asks for tasks less often while its leases come back empty at once."""

import asyncio
import time

from astraflow.rollout.pacing import MAX_RETRY_S, RETRY_S, LeasePacing


def test_empty_leases_answered_at_once_double_the_pause_up_to_its_cap():
    pacing = LeasePacing(long_poll_s=0.5)
    assert pacing.pause_s == RETRY_S
    pauses = []
    for _ in range(12):
        pacing.leased(0, elapsed_s=0.01)
        pauses.append(pacing.pause_s)
    assert pauses[:3] == [2 * RETRY_S, 4 * RETRY_S, 8 * RETRY_S]
    assert pauses == sorted(pauses) and pauses[-1] == MAX_RETRY_S


def test_tasks_or_a_held_long_poll_reset_the_pause():
    pacing = LeasePacing(long_poll_s=0.5)
    for _ in range(4):
        pacing.leased(0, elapsed_s=0.0)
    pacing.leased(3, elapsed_s=0.0)  # tasks came
    assert pacing.pause_s == RETRY_S
    for _ in range(4):
        pacing.leased(0, elapsed_s=0.0)
    pacing.leased(0, elapsed_s=0.5)  # the data layer held the call: the node was waiting there
    assert pacing.pause_s == RETRY_S
    no_long_poll = LeasePacing(long_poll_s=0.0)  # every empty lease is an empty lease at once
    no_long_poll.leased(0, elapsed_s=2.0)
    assert no_long_poll.pause_s == 2 * RETRY_S


def test_a_long_pause_ends_when_new_weights_load():
    pacing = LeasePacing(long_poll_s=0.5)
    for _ in range(8):
        pacing.leased(0, elapsed_s=0.0)

    async def go() -> tuple[float, float]:
        new_weights = asyncio.Event()
        t0 = time.perf_counter()
        await pacing.pause(new_weights)  # nothing loads: the whole pause
        waited = time.perf_counter() - t0
        asyncio.get_running_loop().call_later(0.05, new_weights.set)
        t0 = time.perf_counter()
        await pacing.pause(new_weights)
        return waited, time.perf_counter() - t0

    whole, woken = asyncio.run(go())
    assert whole >= MAX_RETRY_S * 0.9
    assert woken < MAX_RETRY_S  # woken by the load, not the end of the pause
