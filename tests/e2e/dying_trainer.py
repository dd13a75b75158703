"""A test-only advantage estimator whose module kills its trainer worker once, as the trainer's
backend imports it: a trainer worker lost during the run's start-up (before v0 is published).

Named ``tests.e2e.dying_trainer:grpo_after_a_death`` (``trainer.advantage``); it is ``grpo``'s.
The file named in ``DIE_ONCE_ENV`` (the run's processes inherit the variable) records the death:
it is created just before the kill, so the trainer placed on the replacement worker lives. The
head, which checks the name by importing the module, and other workers are not trainer workers.
"""

from __future__ import annotations

import os
import signal

from astraflow.training.algorithms import grpo

#: the environment variable naming the file that records the one death
DIE_ONCE_ENV = "ASTRAFLOW_TEST_DIE_ONCE"


def _in_trainer_worker() -> bool:
    try:
        from distributed import get_worker

        return str(get_worker().name).startswith("trainer")
    except (ImportError, ValueError):  # not in a Dask worker's task
        return False


def _die_once() -> None:
    marker = os.environ.get(DIE_ONCE_ENV)
    if not marker or not _in_trainer_worker():
        return
    try:
        with open(marker, "x") as f:  # only the first trainer worker to get here
            f.write(str(os.getpid()))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


_die_once()
grpo_after_a_death = grpo
