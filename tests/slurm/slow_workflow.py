"""A test-only workflow that paces a run: ``single_turn`` plus a fixed delay per episode.

The elastic end-to-end test adds and removes partitions while a run trains; with a tiny model
on a quiet machine the run would otherwise finish before the test acts, and on a loaded one it
would be much slower. A fixed delay makes the run's pace depend on the number of RaaS nodes
and their capacity, not on the machine. Loaded by workers through the ``module:name`` workflow
plugin form (``tests.slurm.slow_workflow:slow_single_turn_test``).
"""

from __future__ import annotations

import asyncio

from astraflow.rollout.workflows import WORKFLOWS, SingleTurn

DELAY_S = 0.5


@WORKFLOWS.register("slow_single_turn_test")
class SlowSingleTurn(SingleTurn):
    async def run_episode(self, engines, task):
        await asyncio.sleep(DELAY_S)
        return await super().run_episode(engines, task)
