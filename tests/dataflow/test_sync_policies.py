"""The sync baseline with several policies whose trainers are at different versions (a resumed
run interrupted between one trainer's step and the next's): each policy's buffer is asked what
a trainer at its own version could take."""

from __future__ import annotations

import asyncio

import numpy as np

from astraflow.contracts import NOT_GENERATED, Provenance, Sequence, Trajectory
from astraflow.runtime.sync_driver import drive_sync
from tests.dataflow.helpers import store_and_ref
from tests.dataflow.test_gated import _done, _Harness


def _episode(task, versions: dict[str, int]) -> Trajectory:
    """One sequence per policy, its tokens generated at that policy's version."""
    seqs = tuple(Sequence.build(tokens=np.arange(5), loss_mask=[0, 0, 1, 1, 1], logprobs=[0.0] * 5,
                                policy_ids=[NOT_GENERATED] * 2 + [i] * 3,
                                versions=[NOT_GENERATED] * 2 + [versions[p]] * 3,
                                reward=float(int(task.task_id.split("/")[1]) % 2))
                 for i, p in enumerate(task.policies))
    return Trajectory(task.task_id, task.group_id, task.policies, task.workflow, task.kind, task.attempt, seqs,
                      Provenance(node="n0"))


class _TwoPolicies(_Harness):
    """``p`` resumed one version ahead of ``q``; the node generates with each policy's newest."""

    policies = ["p", "q"]

    async def _node(self) -> None:
        writer = self.dl.store.writer("n0")
        while not self.stop:
            tasks = await self.dl.lease("n0", 64)
            if tasks:
                await self.dl.complete(store_and_ref(writer, [_episode(t, self.dl.versions) for t in tasks]))
            await asyncio.sleep(0.005)

    def trainer(self, policy: str):
        harness = self

        class Trainer:
            def state(self):
                return _done({"version": harness.dl.versions[policy]})

            def step(self):
                version = harness.dl.versions[policy]
                harness.call(harness.dl.next_batch(policy, version, timeout=5)).result()
                harness.call(harness.dl.published(policy, version + 1)).result()
                return _done({})
        return Trainer()


def test_a_policy_a_version_ahead_of_another_still_gets_its_batches():
    """Asked at the slower trainer's version, the buffer of the policy ahead held only rows sampled
    after that version: dropped as stale, every iteration waited out the run's deadline."""
    h = _TwoPolicies({"a": 1}, 4, 8)
    try:
        h.call(h.dl.published("p", 1)).result()  # the run stopped after p's step, before q's
        trainers = {p: h.trainer(p) for p in ("p", "q")}
        iterations = drive_sync(h.handle(), trainers, lambda: [], 8, 2, 3, 20.0)
        assert len(iterations) == 3 and h.dl.versions == {"p": 3, "q": 3}
        assert h.dl.buffers.counts["p"]["stale_dropped"] == 0
    finally:
        h.close()
