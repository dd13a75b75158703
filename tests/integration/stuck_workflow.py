"""A test-only workflow whose first RaaS node hangs: ``slow_single_turn_test``, except that on
the worker named ``...-0`` an episode blocks the node's event loop (a synchronous call that does
not return), so that node stops calling the data layer while its Dask worker stays alive.
Loaded by workers through the ``module:name`` workflow form
(``tests.integration.stuck_workflow:stuck_first_node_test``)."""

from __future__ import annotations

import time

from astraflow.rollout.workflows import WORKFLOWS
from tests.slurm.slow_workflow import SlowSingleTurn

STUCK_S = 60.0


@WORKFLOWS.register("stuck_first_node_test")
class StuckFirstNode(SlowSingleTurn):
    async def run_episode(self, engines, task):
        if self.node.endswith("-0"):
            time.sleep(STUCK_S)  # blocks the loop: no heartbeat, no lease call, no other episode
        return await super().run_episode(engines, task)
