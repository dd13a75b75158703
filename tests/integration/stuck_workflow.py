"""A test-only workflow whose first RaaS node hangs: ``slow_single_turn_test``, except that on
the worker named ``...-0`` an episode blocks the node's event loop (a synchronous call that does
not return), so that node stops calling the data layer while its Dask worker stays alive.

The other nodes hold their episodes (awaiting, so they keep heartbeating) until the hung node
has begun to hang, signalled by the file named in ``ASTRAFLOW_TEST_STUCK_MARK``: otherwise a node
that starts serving late on a loaded machine may find the run already finished and never hang.
Loaded by workers through the ``module:name`` workflow form
(``tests.integration.stuck_workflow:stuck_first_node_test``)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from astraflow.rollout.workflows import WORKFLOWS
from tests.slurm.slow_workflow import SlowSingleTurn

STUCK_S = 60.0
HOLD_AT_MOST_S = 180.0


@WORKFLOWS.register("stuck_first_node_test")
class StuckFirstNode(SlowSingleTurn):
    async def run_episode(self, engines, task):
        mark = os.environ.get("ASTRAFLOW_TEST_STUCK_MARK")
        if self.node.endswith("-0"):
            if mark:
                Path(mark).touch()
            time.sleep(STUCK_S)  # blocks the loop: no heartbeat, no lease call, no other episode
        elif mark:
            deadline = time.monotonic() + HOLD_AT_MOST_S
            while not Path(mark).exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        return await super().run_episode(engines, task)
