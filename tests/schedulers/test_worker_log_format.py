"""A worker started with the environment AstraFlow gives its workers writes AstraFlow's own log
lines as Dask writes its own: with the time, the logger and the level, INFO included (bare
lines could not be matched to the run's timeline)."""

from __future__ import annotations

import logging
import os
import re
import time

import pytest
from schedulers import Partition
from schedulers.command import worker_env
from tests.schedulers.dask_fixtures import dask_scheduler  # noqa: F401  (a fixture)
from tests.schedulers.test_dask_main import _joined_worker


@pytest.mark.timeout(120)
def test_astraflow_lines_in_a_worker_log_carry_time_logger_and_level(dask_scheduler, tmp_path):  # noqa: F811
    address, _, client = dask_scheduler
    name = "rollout-r-local-cpu-0"
    env = {**os.environ, **worker_env(Partition(name="r", role="rollout"), name)}
    with _joined_worker(client, address, name, tmp_path / "w.log", env=env):
        # a logger pickles as its name: the worker logs through its own
        client.run(logging.getLogger("astraflow.rollout").info, "episode g1/0 failed: the reward raised")
        deadline = time.monotonic() + 20
        while "episode g1/0" not in (tmp_path / "w.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
    text = (tmp_path / "w.log").read_text()
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ - astraflow\.rollout - INFO - episode g1/0 failed", text,
                     re.MULTILINE), text[-2000:]
