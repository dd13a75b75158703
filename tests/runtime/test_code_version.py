"""A worker that runs other AstraFlow code than the run (the install changed under a live run, or
a partition's jobs use another checkout) is refused before an actor is placed on it, naming
what differs. Real Dask workers: one of the run's code, one started from a copy with one file
changed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import Client, LocalCluster

from astraflow.codeversion import PACKAGES, code_fingerprint, differences
from astraflow.config import ClusterConfig
from astraflow.runtime.placement import Placement
from astraflow.runtime.progress import Progress
from astraflow.runtime.workers import WorkerUnusable
from tests.schedulers.dask_fixtures import wait_for_workers
from storage.paths import RunPaths

REPO = Path(__file__).resolve().parents[2]


def _copy_with_one_change(dest: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(REPO / package, dest / package, ignore=shutil.ignore_patterns("__pycache__"))
    with open(dest / "astraflow" / "cli.py", "a") as f:
        f.write("\n# changed under the live run\n")
    return dest


@pytest.mark.timeout(180)
def test_a_worker_with_other_code_is_refused_before_an_actor_is_placed(tmp_path):
    other = _copy_with_one_change(tmp_path / "other")
    with LocalCluster(n_workers=1, processes=True, threads_per_worker=1, dashboard_address=None,
                      host="127.0.0.1") as cluster, Client(cluster) as client:
        env = {**os.environ, "PYTHONPATH": str(other)}
        with open(tmp_path / "worker.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "schedulers.dask_main", "worker", cluster.scheduler_address,
                                     "--name", "rollout-other", "--nthreads", "1", "--no-nanny", "--no-dashboard",
                                     "--death-timeout", "30"], cwd=tmp_path, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            assert "rollout-other" in wait_for_workers(client, {"rollout-other"}, present=True, deadline_s=60)
            placement = Placement(RunPaths(tmp_path / "run").make(), ClusterConfig(), Progress(enabled=False))
            placement.client = client
            joined = placement.joined()
            same = next(n for n in joined if n != "rollout-other")
            placement.check_code(same, joined[same])  # the run's own code: placed as before
            assert placement.submit_actor(dict, same).result(timeout=60) is not None
            with pytest.raises(WorkerUnusable) as err:  # a RunFailed for a core worker; a node's placement fails
                placement.submit_actor(dict, "rollout-other")
            msg = str(err.value)
            assert "worker rollout-other runs other code than this run" in msg
            assert "1 source file(s) differ (astraflow/cli.py)" in msg and "resume it" in msg
        finally:
            proc.kill()
            proc.wait()


def test_differences_name_versions_and_files_and_the_same_code_has_none():
    mine = code_fingerprint()
    assert differences(mine, mine) == []
    # a patch release of Python and a build label of torch run the same code
    patch = ".".join(mine["python"].split(".")[:2] + ["99"])
    same = {**mine, "python": patch, "versions": {**mine["versions"], "torch": mine["versions"]["torch"].split("+")[0]
                                                  + "+cu130"}}
    assert differences(mine, same) == []
    theirs = {**mine, "python": "3.10.0", "versions": {**mine["versions"], "torch": "2.0.0"},
              "files": {k: ("x" if i < 5 else v) for i, (k, v) in enumerate(mine["files"].items())}}
    said = differences(mine, theirs)
    assert said[0] == f"Python 3.10.0 instead of {mine['python']}"
    assert said[1] == f"torch 2.0.0 instead of {mine['versions']['torch']}"
    assert said[2].startswith("5 source file(s) differ (") and said[2].endswith(" and 2 more)")
