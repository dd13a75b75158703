"""A test-only workflow that paces a run: ``single_turn`` plus a fixed delay per episode.

The elastic end-to-end test adds and removes partitions while a run trains; with a tiny model
on a quiet machine the run would otherwise finish before the test acts, and on a loaded one it
would be much slower. A fixed delay makes the run's pace depend on the number of RaaS nodes
and their capacity, not on the machine. Loaded by workers through the ``module:name`` workflow
plugin form (``tests.slurm.slow_workflow:slow_single_turn_test``).

A test whose last action is done can end the pacing: it names a file in ``PACE_OFF_ENV`` (the
run's processes and Slurm jobs inherit the variable) and creates that file once it no longer
needs the run to be slow, so the remaining steps take the tiny model's own time rather than
the delay's.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from astraflow.rollout.workflows import WORKFLOWS, SingleTurn

DELAY_S = 0.5
#: the environment variable naming the file whose existence ends the pacing
PACE_OFF_ENV = "ASTRAFLOW_TEST_PACE_OFF"


def paced() -> bool:
    """Whether episodes still wait: no pace-off file named, or not created yet."""
    off = os.environ.get(PACE_OFF_ENV)
    return not (off and os.path.exists(off))


def end_pacing(path: Path) -> None:
    """Ends the pacing of the run whose processes were given ``PACE_OFF_ENV=path``."""
    path.touch()


@WORKFLOWS.register("slow_single_turn_test")
class SlowSingleTurn(SingleTurn):
    async def run_episode(self, engines, task):
        if paced():
            await asyncio.sleep(DELAY_S)
        return await super().run_episode(engines, task)
