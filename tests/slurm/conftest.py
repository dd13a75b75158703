"""Slurm test tier: needs a reachable Slurm (a real one; tests/slurm/local_slurm.sh makes one).

With ``ASTRAFLOW_START_SLURM=1`` the session starts the local cluster with that script and
stops it afterwards; otherwise the tests use whatever Slurm answers, and skip when none does.
With ``ASTRAFLOW_REQUIRE_SLURM=1`` (set by tests/run.sh after it started the local cluster) an
unreachable Slurm *fails* the tier instead of skipping it, so CI cannot pass without it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.schedulers.dask_fixtures import dask_scheduler  # noqa: F401  (a fixture)

SCRIPT = Path(__file__).with_name("local_slurm.sh")


@functools.lru_cache(maxsize=1)
def _slurm_answers() -> tuple[bool, str]:
    if shutil.which("sinfo") is None:
        return False, "sinfo is not installed (run tests/slurm/local_slurm.sh or set ASTRAFLOW_START_SLURM=1)"
    # -h: no banner; a down slurmctld makes the client retry for ~10 s, hence the short timeout
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=5)
    except subprocess.TimeoutExpired:
        return False, "slurmctld does not answer `sinfo` within 5 s (start it: tests/slurm/local_slurm.sh)"
    if proc.returncode != 0:
        return False, f"slurmctld does not answer `sinfo`: {proc.stderr.strip()} (start it: tests/slurm/local_slurm.sh)"
    return True, ""


@pytest.fixture(scope="session")
def slurm_cluster():
    """Ensures a Slurm cluster answers for the session (starting the local one when asked)."""
    started = False
    if os.environ.get("ASTRAFLOW_START_SLURM") == "1":
        subprocess.run(["bash", str(SCRIPT), "start"], check=True, timeout=300)
        started = True
        _slurm_answers.cache_clear()
    ok, why = _slurm_answers()
    if not ok:
        if os.environ.get("ASTRAFLOW_REQUIRE_SLURM") == "1":
            pytest.fail(f"ASTRAFLOW_REQUIRE_SLURM=1 but Slurm is unreachable: {why}", pytrace=False)
        pytest.skip(why)
    yield
    if started:
        subprocess.run(["bash", str(SCRIPT), "stop"], check=True, timeout=60)


@pytest.fixture(autouse=True)
def _needs_slurm(request):
    """Tests marked `slurm` get the session cluster (or a skip saying why there is none)."""
    if request.node.get_closest_marker("slurm") is not None:
        request.getfixturevalue("slurm_cluster")
