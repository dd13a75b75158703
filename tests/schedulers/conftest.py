"""Fixtures for the scheduler-backend tests."""

import pytest

from tests.schedulers.dask_fixtures import dask_scheduler  # noqa: F401  (a fixture)


@pytest.fixture(autouse=True, scope="module")
def node_tmpdir(tmp_path_factory):
    """``$TMPDIR`` of the Dask processes these tests start: the private directory of a worker the
    tests kill outright (which cannot remove it) stays in pytest's temporary tree, not in /tmp."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(tmp_path_factory.mktemp("node-tmp")))
        yield
