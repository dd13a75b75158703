"""A test-only workflow that lets a test hold a run at a trainer step: ``single_turn`` whose
episodes are not handed back while they were generated with weights at or past a version the
test names.

The browser test must see the trainer step change on the page. The tiny run can train all its
steps before a loaded machine renders the page once, so the page could first show the run's
last step. Holding the run keeps its step still while the page catches up, whatever the
machine's pace: the test names the version in the file ``$HOLD_ENV`` points to (``0``: nothing
is handed back, the trainer stays at step 0; ``3``: the trainer gets data up to version 2, so
it stops between step 3 and ``3 + max_staleness``), and removes the file to let the run finish.
A held episode's node keeps heartbeating, so its leases stay renewed. Loaded by workers through
the ``module:name`` workflow plugin form (``tests.monitoring.held_workflow:held_single_turn_test``);
workers inherit the environment.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from astraflow.rollout.workflows import WORKFLOWS, SingleTurn

HOLD_ENV = "ASTRAFLOW_TEST_HOLD_FILE"
POLL_S = 0.05


def held_from() -> int | None:
    """The first weight version whose episodes are held, or None when the run is released."""
    path = os.environ.get(HOLD_ENV)
    try:
        return int(Path(path).read_text()) if path else None
    except FileNotFoundError:
        return None


def hold(path: Path, version: int | None) -> None:
    """Hold episodes of ``version`` and later (None: release the run). The file is replaced
    in one step, so a worker never reads it half written."""
    if version is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(version))
    os.replace(tmp, path)


@WORKFLOWS.register("held_single_turn_test")
class HeldSingleTurn(SingleTurn):
    async def run_episode(self, engines, task):
        traj = await super().run_episode(engines, task)
        newest = max((int(s.versions.max()) for s in traj.sequences if s.versions.size), default=0)
        while (h := held_from()) is not None and newest >= h:
            await asyncio.sleep(POLL_S)
        return traj
