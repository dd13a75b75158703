"""Slurm test tier: needs a reachable Slurm (a real one; tests/slurm/local_slurm.sh makes one).

With ``ASTRAFLOW_START_SLURM=1`` the session starts the local cluster with that script and
stops it afterwards; otherwise the tests use whatever Slurm answers, and skip when none does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.schedulers.dask_fixtures import dask_scheduler  # noqa: F401  (a fixture)

SCRIPT = Path(__file__).with_name("local_slurm.sh")


def _slurm_answers() -> tuple[bool, str]:
    if shutil.which("sinfo") is None:
        return False, "sinfo is not installed (run tests/slurm/local_slurm.sh or set ASTRAFLOW_START_SLURM=1)"
    proc = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20)
    if proc.returncode != 0 or "UP" not in proc.stdout:
        return False, f"slurmctld does not answer `scontrol ping`: {proc.stdout.strip()} {proc.stderr.strip()}"
    return True, ""


@pytest.fixture(scope="session")
def slurm_cluster():
    """Ensures a Slurm cluster answers for the session (starting the local one when asked)."""
    started = False
    if os.environ.get("ASTRAFLOW_START_SLURM") == "1":
        subprocess.run(["bash", str(SCRIPT), "start"], check=True, timeout=300)
        started = True
    ok, why = _slurm_answers()
    if not ok:
        pytest.skip(why)
    yield
    if started:
        subprocess.run(["bash", str(SCRIPT), "stop"], check=True, timeout=60)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slurm") is not None:
            item.fixturenames.append("slurm_cluster")
